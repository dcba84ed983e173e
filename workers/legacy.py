"""The keywords of earlier releases of ``SamplerPool`` and ``ClusterSampler``: which object each
goes into, the strategy that ``sampler=`` and its options spell, and how the warning spells the
new form and finds the caller's line. ``workers.config.legacy_options`` puts them together.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from types import FrameType
from typing import Any

from shmbuf.checks import positive_int
from shmbuf.limiter import RateLimit
from shmbuf.sampling.plan import Plan

from .errors import OptionError
from .selection import Counted, Epoch, Prioritized, Queue, SelectionSpec, Uniform

# Each earlier keyword, by the object that now holds it (and its name there).
WORKERS = {"n_workers": "n", "n_staging": "staging", "start_method": "start_method",
           "max_restarts_per_minute": "max_restarts_per_minute", "ordered": "ordered"}
PRIORITIZED = {"alpha": "alpha", "beta": "beta", "eps": "eps", "priority_eta": "eta"}
EPOCH = {"drop_last": "drop_last", "carry_remainder": "carry_remainder"}
PLAN = [f.name for f in dataclasses.fields(Plan)]
SELECTION = ["sampler", *PRIORITIZED, *EPOCH, "max_times_sampled"]
LIMIT = ["min_size", "samples_per_insert"]
LEGACY_KEYWORDS = frozenset({*WORKERS, *SELECTION, *LIMIT, *PLAN, "pin_memory",
                             "device_prefetch", "transform_spec"})


def callers_level() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in the function that calls this) of the first
    frame outside the ``workers`` package: the user's call, however many of our frames
    (``SamplerPool.__init__``, ``ReplayCluster.sampler``, ``ClusterSampler.__init__``...) lie
    between, so that the warning names the line to change and Python's default filter, which
    shows a ``DeprecationWarning`` only where ``__main__`` triggers it, shows it to scripts."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame: FrameType | None = sys._getframe(2)  # (level 1: the caller of this function)
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def spelled(value: Any) -> str:
    """``value`` as it would be written: a dataclass with only its fields that differ from
    their defaults (``Prioritized(alpha=0.3)``, ``Workers(n=0)``)."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return "fn" if callable(value) else repr(value)
    parts = []
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        default = (f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING
                   else object())
        if f.init and v != default:
            parts.append(f"{f.name}={spelled(v)}")
    return f"{type(value).__name__}({', '.join(parts)})"


def selection_of(sampler: Any, prioritized: dict[str, Any], epoch: dict[str, Any],
                 k: Any) -> SelectionSpec:
    """The strategy of ``sampler=`` with its options (``alpha``..., ``drop_last``...,
    ``max_times_sampled``), refusing options the strategy does not take."""
    name = "uniform" if sampler is None else sampler
    if name not in ("uniform", "prioritized", "queue", "epoch"):
        raise ValueError(f"sampler must be 'uniform', 'prioritized', 'queue' or 'epoch', got "
                         f"{sampler!r}")
    misplaced = []  # every option the strategy does not take, with the object that takes it
    if prioritized and name != "prioritized":
        opts = ", ".join(f"{key}={v!r}" for key, v in prioritized.items())
        olds = ", ".join(old for old, new in PRIORITIZED.items() if new in prioritized)
        verb = "belongs" if len(prioritized) == 1 else "belong"
        misplaced.append(f"{olds} {verb} to prioritized sampling "
                         f"(selection=Prioritized({opts}))")
    if epoch and name != "epoch":
        opts = ", ".join(f"{key}={v!r}" for key, v in epoch.items())
        verb = "belongs" if len(epoch) == 1 else "belong"
        misplaced.append(f"{', '.join(epoch)} {verb} to epochs (selection=Epoch({opts}))")
    if misplaced:
        raise OptionError(f"{'; '.join(misplaced)}, not to sampler={name!r}: pass the object "
                          f"that takes them, or drop them")
    if name == "epoch":
        if k is not None:
            raise OptionError(f"sampler='epoch' delivers each transition once per epoch: drop "
                              f"max_times_sampled={k} and pass selection=Epoch(...)")
        return Epoch(**epoch)
    if name == "queue":
        if k not in (None, 1):
            raise OptionError("sampler='queue' delivers each transition exactly once: drop "
                              f"max_times_sampled={k} and pass selection=Queue()")
        return Queue()
    of: Uniform | Prioritized = Prioritized(**prioritized) if name == "prioritized" else Uniform()
    return of if k is None else Counted(k, of)


def limit_of(given: dict[str, Any]) -> RateLimit:
    """``min_size`` and ``samples_per_insert=(ratio, tolerance)`` as a ``RateLimit``."""
    min_size = positive_int("min_size", given.get("min_size", 1))
    spi = given.get("samples_per_insert")
    if spi is None:
        return RateLimit(min_size)
    try:
        ratio, tolerance = spi
        ratio, tolerance = float(ratio), float(tolerance)
    except (TypeError, ValueError):
        raise ValueError(f"samples_per_insert must be (ratio, tolerance), e.g. (8.0, 1024), got "
                         f"{spi!r}") from None
    return RateLimit(min_size, ratio, tolerance)
