"""``PoolConfig``: every ``SamplerPool`` argument, validated once and frozen.

Checks here need no buffer and start nothing, so a wrong argument fails at the call site before
any process or segment exists. What depends on the buffer (the plan, the transform's outputs) is
checked by ``SamplerPool`` right after.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import cloudpickle
import numpy as np

from shmbuf.checks import positive_int, timeout_seconds
from shmbuf.layout import MAX_SAMPLERS
from shmbuf.limiter import RateLimit
from shmbuf.sampling.plan import Plan
from shmbuf.window_priority import R2D2_ETA, checked_eta

OUTPUTS = ("numpy", "torch", "jax")
SELECTIONS = ("uniform", "prioritized", "queue", "epoch")  # the ``sampler=`` keyword's values


@dataclass(frozen=True)
class PoolConfig:
    """The pool's settings (see ``SamplerPool`` for each argument's meaning).

    Normalised: ``n_workers``/``n_staging`` resolved from their defaults, ``output`` is "torch"
    with a ``device``, ``ordered`` is true for the queue, ``seed`` a ``SeedSequence``, ``limit``
    the parsed ``samples_per_insert``, ``beta`` a schedule ``f(batches) -> beta``.
    """

    batch_size: int
    n_workers: int
    n_staging: int
    seed: np.random.SeedSequence
    start_method: str | None
    transform: Any
    transform_spec: dict[str, Any] | None
    fields: list[str] | None
    plan: Plan
    min_size: int
    limit: RateLimit | None
    timeout: float
    output: str
    ordered: bool
    pin_memory: bool
    max_restarts_per_minute: float
    selection: str  # the ``sampler=`` keyword: how rows are chosen (``selection.py``)
    alpha: float
    beta: Callable[[int], float]
    eps: float
    max_times_sampled: int | None
    device: Any
    device_prefetch: int
    # sampler="epoch": an epoch's rows short of a whole batch make a "short" last batch, are
    # skipped ("drop"), or open the next epoch's first batch ("carry"): ``EpochSelection``
    epoch_remainder: str = "drop"
    priority_eta: float = R2D2_ETA  # prioritized sequences: eta * max + (1 - eta) * mean

    @classmethod
    def from_args(cls, *, batch_size: int, n_workers: int | None, n_staging: int | None,
                  seed: Any, start_method: str | None, transform: Any, min_size: int,
                  samples_per_insert: Any, timeout: float, output: str, ordered: bool,
                  pin_memory: bool, max_restarts_per_minute: float, fields: list[str] | None,
                  transform_spec: dict[str, Any] | None, plan: Plan | None, sampler: str,
                  alpha: float, beta: Any, eps: float, max_times_sampled: int | None,
                  device: Any, device_prefetch: int, plan_kwargs: dict[str, Any],
                  drop_last: bool = True, carry_remainder: bool = False,
                  priority_eta: float = R2D2_ETA) -> PoolConfig:
        """Validate the constructor's arguments; raise ``ValueError``/``TypeError`` naming the
        argument, the value given and the fix."""
        if device is not None:
            device_prefetch = positive_int("device_prefetch", device_prefetch)
            if output not in ("numpy", "torch"):
                raise ValueError(f"device= delivers torch tensors; drop output={output!r}")
            output = "torch"
        if plan is None:
            plan = Plan(**plan_kwargs)
        elif plan_kwargs:
            raise ValueError(f"pass either plan= or its options, not both ({plan_kwargs})")
        batch_size = positive_int("batch_size", batch_size)
        if n_workers is None:
            n_workers = max(1, min(4, (os.cpu_count() or 2) - 1))
        if not isinstance(n_workers, int) or not 0 <= n_workers <= MAX_SAMPLERS:
            raise ValueError(f"n_workers must be an int in [0, {MAX_SAMPLERS}], got {n_workers!r}")
        if n_staging is None:
            n_staging = 2 * n_workers + 2 if n_workers else 1
        if not isinstance(n_staging, int) or n_staging < max(1, n_workers + 1):
            raise ValueError(
                f"n_staging must be an int >= n_workers + 1 = {n_workers + 1} (one slot per "
                f"worker plus the one the learner holds), got {n_staging!r}"
            )
        if output not in OUTPUTS:
            raise ValueError(f"output must be 'numpy', 'torch' or 'jax', got {output!r}")
        timeout = timeout_seconds("timeout", timeout, positive=True)
        min_size = positive_int("min_size", min_size)
        limit = _rate_limit(samples_per_insert, min_size, batch_size)
        if max_restarts_per_minute < 0:
            raise ValueError(
                f"max_restarts_per_minute must be >= 0, got {max_restarts_per_minute}")
        if sampler not in SELECTIONS:
            raise ValueError(f"sampler must be 'uniform', 'prioritized', 'queue' or 'epoch', got "
                             f"{sampler!r}")
        times = max_times_sampled
        if times is not None and (isinstance(times, bool) or not isinstance(times, int)
                                  or times < 1):
            raise ValueError(f"max_times_sampled must be a positive int, got {times!r}")
        beta_at = beta_schedule(beta)
        remainder = epoch_remainder(drop_last, carry_remainder)
        eta = checked_eta(priority_eta)
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {type(transform).__name__}")
        _check_picklable(transform)  # serialised here: an unpicklable one fails at the call site
        return cls(
            batch_size=batch_size, n_workers=n_workers, n_staging=n_staging,
            seed=seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed),
            start_method=start_method, transform=transform, transform_spec=transform_spec,
            fields=fields, plan=plan, min_size=min_size, limit=limit, timeout=timeout,
            output=output, ordered=bool(ordered) or sampler in ("queue", "epoch"),
            pin_memory=pin_memory,
            max_restarts_per_minute=max_restarts_per_minute, selection=sampler, alpha=alpha,
            beta=beta_at, eps=eps, max_times_sampled=times, device=device,
            device_prefetch=device_prefetch, epoch_remainder=remainder, priority_eta=eta,
        )

    def output_arrays(self, compiled: Any) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        """(name, shape without batch, dtype) of each delivered field: the plan's outputs, or the
        transform's (from ``transform_spec``, else by calling it once on a zero batch here)."""
        base = list(compiled.outputs)
        transform = self.transform
        if transform is None:
            return base
        if self.transform_spec is not None:
            return [(n, tuple(s), np.dtype(d)) for n, (s, d) in self.transform_spec.items()]
        example = {n: np.zeros((self.batch_size, *shape), dtype) for n, shape, dtype in base}
        try:
            result = transform(dict(example))
        except Exception as e:
            raise TypeError(
                f"transform {callable_name(transform)} failed on a zero-filled example batch "
                f"({type(e).__name__}: {e}); fix it, or pass transform_spec= to skip this check"
            ) from e
        result = example if result is None else result
        out = []
        for name, value in result.items():
            arr = np.asarray(value)
            if arr.ndim == 0 or arr.shape[0] != self.batch_size or arr.dtype == object:
                raise TypeError(
                    f"transform {callable_name(transform)} returned {name!r} with shape "
                    f"{arr.shape} dtype {arr.dtype}; every output must be a numeric array of "
                    f"shape (batch_size={self.batch_size}, ...)"
                )
            out.append((str(name), arr.shape[1:], arr.dtype))
        return out


def epoch_remainder(drop_last: Any, carry_remainder: Any) -> str:
    """``EpochSelection``'s remainder mode from ``drop_last`` and ``carry_remainder``."""
    for name, value in (("drop_last", drop_last), ("carry_remainder", carry_remainder)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if carry_remainder:
        if drop_last:
            raise ValueError("carry_remainder=True carries an epoch's last rows into the next "
                             "batch instead of dropping them: pass drop_last=False with it")
        return "carry"
    return "drop" if drop_last else "short"


def _rate_limit(samples_per_insert: Any, min_size: int, batch_size: int) -> RateLimit | None:
    if samples_per_insert is None:
        return None
    try:
        ratio, tolerance = samples_per_insert
        ratio, tolerance = float(ratio), float(tolerance)
    except (TypeError, ValueError):
        raise ValueError(
            f"samples_per_insert must be (ratio, tolerance), e.g. (8.0, 1024), got "
            f"{samples_per_insert!r}"
        ) from None
    if tolerance < batch_size:
        raise ValueError(
            f"samples_per_insert tolerance {tolerance:g} is smaller than batch_size "
            f"{batch_size}: samplers could never take a whole batch. Fix: a tolerance of at "
            f"least a few batches, e.g. ({ratio:g}, {4 * batch_size})"
        )
    if tolerance < ratio:
        raise ValueError(
            f"samples_per_insert tolerance {tolerance:g} is smaller than samples_per_insert "
            f"{ratio:g}: one insert moves the balance by {ratio:g} samples, so writers and "
            f"samplers could end up waiting for each other (Reverb refuses this too). Fix: a "
            f"tolerance of at least the ratio, e.g. ({ratio:g}, {max(ratio, 4 * batch_size):g})"
        )
    return RateLimit(min_size, ratio, tolerance)


def beta_schedule(beta: Any) -> Callable[[int], float]:
    """beta as a function of batches delivered: a number, (start, end, n) linear, a callable."""
    if callable(beta):
        return beta
    if isinstance(beta, (tuple, list)):
        start, end, n_batches = beta
        if n_batches <= 0:
            raise ValueError(
                f"beta schedule (start, end, n_batches) needs n_batches > 0, got {n_batches}")
        return lambda step: start + (end - start) * min(1.0, step / n_batches)
    constant = float(beta)
    if not 0 <= constant <= 1:
        raise ValueError(f"beta must be in [0, 1] (or a schedule), got {beta!r}")
    return lambda step: constant


def callable_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _check_picklable(fn: Any) -> None:
    if fn is None:
        return
    try:
        cloudpickle.dumps(fn)
    except Exception as e:
        raise TypeError(
            f"transform {callable_name(fn)} cannot be serialised for the worker processes "
            f"({type(e).__name__}: {e}). Fix: avoid capturing unpicklable objects (locks, open "
            f"files, sockets) in it; create them inside the function instead"
        ) from e
