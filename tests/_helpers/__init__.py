"""Helpers shared by the tests, ``scripts/stress.py`` and the benchmarks; NumPy only (no shmbuf),
so a script can import them by putting the repository root on ``sys.path``."""
