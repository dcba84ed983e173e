"""shmbuf workers: the processes around a replay buffer.

``SamplerPool`` (sampler workers prefetching batches into a shared-memory staging ring, with
supervision and rate limiting) and ``ActorGroup`` (supervised actor processes that write to the
buffer, one lane each).
"""

from __future__ import annotations

from .actors import ActorContext, ActorGroup
from .batch import Batch
from .pool import SamplerPool

__all__ = ["ActorContext", "ActorGroup", "Batch", "SamplerPool"]
