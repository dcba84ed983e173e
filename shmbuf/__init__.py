"""shmbuf: replay buffers in POSIX shared memory for multiprocess actor-learner RL.

Storage only (no processes): segments, layout, lanes, the per-slot seqlock, the ``ReplayBuffer``
API, sampling index math and persistence. Process pools live in the ``workers`` package.
"""

from __future__ import annotations

from .buffer import ReplayBuffer, Writer
from .errors import (
    ActorError,
    BufferInUseError,
    CapacityError,
    CheckpointError,
    ClosedError,
    DeviceUnavailableError,
    EmptyBufferError,
    InvalidPriorityError,
    LaneBusyError,
    RateLimitTimeout,
    SamplingError,
    SegmentExistsError,
    SegmentFormatError,
    SegmentNotFoundError,
    ShmbufError,
    SpecMismatchError,
    StaleIndexError,
    Timeout,
    UnsupportedPlatformError,
    WorkerDiedError,
    WorkerError,
)
from .limiter import RateLimit
from .recording import RecordEpisodes, iter_episodes, scan_episodes
from .spec import Field, Spec
from .weights import TornReadError, WeightStore

__version__ = "0.1.0"

__all__ = [
    "ActorError",
    "BufferInUseError",
    "CapacityError",
    "CheckpointError",
    "ClosedError",
    "DeviceUnavailableError",
    "EmptyBufferError",
    "Field",
    "InvalidPriorityError",
    "LaneBusyError",
    "RateLimit",
    "RateLimitTimeout",
    "RecordEpisodes",
    "ReplayBuffer",
    "SamplingError",
    "SegmentExistsError",
    "SegmentFormatError",
    "SegmentNotFoundError",
    "ShmbufError",
    "Spec",
    "SpecMismatchError",
    "StaleIndexError",
    "Timeout",
    "TornReadError",
    "UnsupportedPlatformError",
    "WeightStore",
    "WorkerDiedError",
    "WorkerError",
    "Writer",
    "__version__",
    "iter_episodes",
    "scan_episodes",
]
