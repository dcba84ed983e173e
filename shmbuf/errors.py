"""The one exception hierarchy of shmbuf and its workers.

Every error says what was wrong, the value that was given, and how to fix it. Each also derives
from the closest builtin (``ValueError``, ``TimeoutError``, ...) so generic handlers still work.
"""

from __future__ import annotations


class ShmbufError(Exception):
    """Base class of every error raised by shmbuf and its workers."""


class CapacityError(ShmbufError, OSError):
    """Shared memory is too small for what was asked (e.g. a Docker /dev/shm of 64 MB)."""


class SpecMismatchError(ShmbufError, ValueError):
    """Data, a checkpoint or a segment does not match the buffer's spec.

    Raised before anything in shared memory changes.
    """


class SegmentExistsError(ShmbufError, FileExistsError):
    """A segment with this name already exists."""


class SegmentNotFoundError(ShmbufError, FileNotFoundError):
    """No segment with this name exists (never created, or already unlinked)."""


class SegmentFormatError(ShmbufError, ValueError):
    """A segment is not a shmbuf segment of a supported format, or belongs to another user."""


class ClosedError(ShmbufError, ValueError):
    """The buffer, writer, pool or batch was used after it was closed or released."""


class BufferInUseError(ShmbufError, BufferError):
    """Memory could not be unmapped because NumPy arrays still view it."""


class EmptyBufferError(ShmbufError, ValueError):
    """Sampling was asked of a buffer (or lane) that holds no transitions."""


class StaleIndexError(ShmbufError, IndexError):
    """An index refers to a transition that was overwritten or not yet written."""


class InvalidPriorityError(ShmbufError, ValueError):
    """A priority was NaN, infinite, negative or so large that a sum of the tree could overflow
    (``update_priorities``: nothing was updated), or a writer was given priorities that are not
    one finite number >= 0 per row (``extend(rows, priorities=)``: nothing was written)."""


class CheckpointError(ShmbufError, ValueError):
    """A saved buffer or state dict is truncated, incomplete or inconsistent."""


class SamplingError(ShmbufError, RuntimeError):
    """Rows kept failing their seqlock check past the retry bound."""


class Timeout(ShmbufError, TimeoutError):
    """A blocking call ran out of time. Nothing was changed."""


class LaneBusyError(Timeout):
    """No lane became free for a writer before the timeout."""


class RateLimitTimeout(Timeout):
    """A writer or sampler waited on the rate limiter past its timeout."""


class WorkerDiedError(ShmbufError, RuntimeError):
    """A worker process died and could not be (or may no longer be) restarted."""


class WorkerError(ShmbufError, RuntimeError):
    """User code in a sampler worker (e.g. a transform) raised; carries the worker's traceback."""


class ActorError(ShmbufError, RuntimeError):
    """An actor function raised; the message carries the actor's traceback."""


class DeviceUnavailableError(ShmbufError, RuntimeError):
    """A device was asked for that this process cannot use (no CUDA, no torch, bad ordinal)."""


class UnsupportedPlatformError(ShmbufError, RuntimeError):
    """This machine lacks what the shared-memory protocol relies on (x86-64 store ordering)."""
