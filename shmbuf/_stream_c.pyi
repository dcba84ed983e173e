# The optional streaming row stores of a writer (_stream_c.c): see that file.
import numpy as np

def store_rows(column: np.ndarray, first: int, values: object, count: int) -> bool: ...
