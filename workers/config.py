"""``SamplerPool``'s options as objects, and ``PoolConfig``: all of them validated once, frozen.

What a pool is made of, in Reverb's and TorchRL's manner: a ``selection`` strategy
(``workers.selection``), a ``limit`` (``shmbuf.RateLimit``), a ``plan`` (``shmbuf.sampling.Plan``),
and here ``Workers`` (the sampler processes), ``Output`` (the arrays' kind), ``Device`` (batches
delivered on a torch device) and ``Transform`` (user code run in the workers). Each checks its
own options when it is made; ``PoolConfig.make`` checks how they combine, with no buffer and
before any process or segment exists, so a wrong argument fails at the call site.
``legacy_options`` turns the keywords of earlier releases into these objects (``workers.legacy``
says which goes where), with a ``DeprecationWarning``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

from shmbuf.checks import positive_int, timeout_seconds
from shmbuf.layout import MAX_SAMPLERS
from shmbuf.limiter import RateLimit
from shmbuf.sampling.plan import Plan

from .errors import OptionError
from .legacy import (
    EPOCH,
    LEGACY_KEYWORDS,
    LIMIT,
    PLAN,
    PRIORITIZED,
    SELECTION,
    WORKERS,
    callers_level,
    limit_of,
    selection_of,
    spelled,
)
from .selection import Prioritized, SelectionSpec, selection_spec

OUTPUTS = ("numpy", "torch", "jax")


@dataclass(frozen=True)
class Workers:
    """The sampler processes of a pool.

    Args:
        n: processes (0: sample in the learner's own process, behind the same API). Default:
            cores - 1, between 1 and 4.
        staging: staging slots (batches in flight), at least ``n + 1``; default ``2n + 2``.
        start_method: "fork", "forkserver" or "spawn" (default: multiprocess's).
        max_restarts_per_minute: restart budget for dead workers (a rate, not a total).
        ordered: deliver batches in the order they were handed out (reproducible with a seed;
            queues and epochs always are).

    ``workers=4`` is short for ``Workers(4)``.
    """

    n: int | None = None
    staging: int | None = None
    start_method: str | None = None
    max_restarts_per_minute: float = 10.0
    ordered: bool = False

    def __post_init__(self) -> None:
        n = self.n
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer))
                              or not 0 <= n <= MAX_SAMPLERS):
            raise ValueError(f"Workers(n={n!r}): n must be an int in [0, {MAX_SAMPLERS}]")
        if self.start_method not in (None, "fork", "forkserver", "spawn"):
            raise ValueError(f"Workers(start_method={self.start_method!r}): use 'fork', "
                             f"'forkserver' or 'spawn'")
        rate = self.max_restarts_per_minute
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
            raise ValueError(f"Workers(max_restarts_per_minute={rate!r}) must be >= 0")
        if not isinstance(self.ordered, (bool, np.bool_)):
            raise TypeError(f"Workers(ordered={self.ordered!r}): ordered must be a bool")
        count = self.count
        staging = self.staging
        if staging is not None and (isinstance(staging, bool) or not isinstance(staging, int)
                                    or staging < max(1, count + 1)):
            raise ValueError(
                f"Workers(staging={staging!r}): at least n + 1 = {count + 1} slots (one per "
                f"worker plus the one the learner holds)")

    @property
    def count(self) -> int:
        """``n`` resolved from its default."""
        return int(self.n) if self.n is not None else max(1, min(4, (os.cpu_count() or 2) - 1))

    @property
    def slots(self) -> int:
        """``staging`` resolved from its default."""
        n = self.count
        return self.staging if self.staging is not None else (2 * n + 2 if n else 1)


@dataclass(frozen=True)
class Output:
    """What the learner's batches hold: "numpy" views of the staging slot, "torch" tensors over
    them (``torch.from_numpy``, no copy), or "jax" arrays (zero-copy DLPack imports with
    workers, copies in-process; a slot is refilled once JAX has let go of them).

    Args:
        kind: "numpy", "torch" or "jax". ``output="torch"`` is short for ``Output("torch")``.
        pin_memory: with "torch" and CUDA, page-lock the staging ring so host-to-device copies
            are asynchronous; a slot is refilled only once an event recorded on the current
            CUDA stream at its release has passed.
    """

    kind: str = "numpy"
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if self.kind not in OUTPUTS:
            raise ValueError(f"Output({self.kind!r}): the kind is 'numpy', 'torch' or 'jax'")
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"Output(pin_memory={self.pin_memory!r}) must be a bool")


@dataclass(frozen=True)
class Device:
    """Batches delivered on a torch device: the pool copies each ready slot from the
    page-locked ring on its own CUDA stream, ``prefetch`` batches ahead, and fences every copy
    (no synchronize anywhere). ``device="cuda"`` is short for ``Device("cuda")``."""

    device: Any
    prefetch: int = 2

    def __post_init__(self) -> None:
        positive_int("Device(prefetch=...)", self.prefetch)


@dataclass(frozen=True)
class Transform:
    """``fn(batch: dict) -> dict`` run in the workers before staging (serialised with
    cloudpickle here, so a lambda works under every start method). ``spec``: its outputs as
    ``{name: (shape_without_batch, dtype)}``; by default found by calling ``fn`` once on a zero
    batch in the learner. ``transform=fn`` is short for ``Transform(fn)``."""

    fn: Callable[[dict[str, np.ndarray]], Any]
    spec: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"Transform(fn={self.fn!r}): transform must be callable, got "
                            f"{type(self.fn).__name__} (pass fn(batch: dict) -> dict)")
        if self.spec is not None and not isinstance(self.spec, dict):
            raise TypeError(f"Transform(spec={self.spec!r}): spec is the outputs as "
                            f"{{name: (shape_without_batch, dtype)}}, or None to find them")
        _check_picklable(self.fn)  # serialised here: an unpicklable one fails at the call site


@dataclass(frozen=True)
class PoolConfig:
    """The pool's settings, resolved: the strategy objects, and the values the delivery reads
    (``n_workers``, ``n_staging``, ``limit`` the ratio if any, ``min_size``, ``beta(step)``...).
    """

    batch_size: int
    selection: SelectionSpec
    workers: Workers
    seed: np.random.SeedSequence
    transform: Any
    transform_spec: dict[str, Any] | None
    fields: list[str] | None
    plan: Plan
    min_size: int
    limit: RateLimit | None  # the ratio, if the pool has one (it then holds the limiter)
    timeout: float
    output: str
    pin_memory: bool
    device: Any
    device_prefetch: int

    # -- the values the delivery reads ---------------------------------------------------------
    @property
    def n_workers(self) -> int:
        return self.workers.count

    @property
    def n_staging(self) -> int:
        return self.workers.slots

    @property
    def start_method(self) -> str | None:
        return self.workers.start_method

    @property
    def max_restarts_per_minute(self) -> float:
        return self.workers.max_restarts_per_minute

    @property
    def ordered(self) -> bool:
        return self.workers.ordered or self.selection.ordered

    def beta(self, step: int) -> float:
        """The importance-weight exponent after ``step`` batches."""
        return self.selection.beta_at(step)

    @classmethod
    def make(cls, batch_size: int, *, selection: Any, limit: RateLimit | None, plan: Plan | None,
             workers: Workers | int | None, output: Output | str, device: Device | Any,
             transform: Transform | Any, fields: list[str] | None, seed: Any, timeout: float
             ) -> PoolConfig:
        """Resolve ``SamplerPool``'s arguments; raise ``ValueError``/``TypeError`` naming the
        argument, the value given and the fix."""
        batch_size = positive_int("batch_size", batch_size)
        spec = selection_spec(selection)
        if workers is None or isinstance(workers, (int, np.integer)) \
                and not isinstance(workers, bool):
            workers = Workers(workers if workers is None else int(workers))
        if not isinstance(workers, Workers):
            raise TypeError(f"workers={workers!r}: pass a number of processes or Workers(...)")
        out = Output(output) if isinstance(output, str) else output
        if not isinstance(out, Output):
            raise TypeError(f"output={output!r}: pass 'numpy', 'torch', 'jax' or Output(...)")
        dev = device if isinstance(device, Device) or device is None else Device(device)
        if dev is not None and out.kind == "jax":
            raise ValueError("device= delivers torch tensors; drop output='jax'")
        fn = transform if isinstance(transform, Transform) or transform is None \
            else Transform(transform)
        if limit is not None and not isinstance(limit, RateLimit):
            raise TypeError(
                f"limit={limit!r}: pass shmbuf.RateLimit(min_size, samples_per_insert, "
                f"tolerance)")
        limit = limit or RateLimit()
        ratio = _checked_ratio(limit, batch_size)
        if plan is None:
            plan = Plan()
        if not isinstance(plan, Plan):
            raise TypeError(f"plan={plan!r}: pass shmbuf.sampling.Plan(...)")
        return cls(
            batch_size=batch_size, selection=spec, workers=workers,
            seed=seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed),
            transform=fn.fn if fn is not None else None,
            transform_spec=fn.spec if fn is not None else None,
            fields=fields, plan=plan, min_size=int(limit.min_size), limit=ratio,
            timeout=timeout_seconds("timeout", timeout, positive=True),
            output="torch" if dev is not None else out.kind, pin_memory=out.pin_memory,
            device=dev.device if dev is not None else None,
            device_prefetch=dev.prefetch if dev is not None else 2,
        )

    def output_arrays(self, compiled: Any) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        """(name, shape without batch, dtype) of each delivered field: the plan's outputs, or the
        transform's (from ``Transform.spec``, else by calling it once on a zero batch here)."""
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
                f"({type(e).__name__}: {e}); fix it, or pass transform=Transform(fn, spec=...) "
                f"to skip this check"
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


# -- the keywords of earlier releases -----------------------------------------------------------
def legacy_options(given: dict[str, Any], new: dict[str, Any], who: str = "SamplerPool",
                   spelled_as: dict[str, str] | None = None) -> dict[str, Any]:
    """The arguments ``new`` (``selection``, ``limit``, ``plan``, ``workers``, ``output``,
    ``device``, ``transform``, as passed) with the earlier releases' keywords ``given`` turned
    into the objects that now hold them, and a ``DeprecationWarning`` that shows the new form.
    ``spelled_as``: the names the caller used for keywords of ``given`` it renamed (the
    cluster's ``workers_per_node`` for ``n_workers``), for the messages.

    Raises:
        TypeError: a keyword no release took.
        OptionError: an option the chosen strategy does not take (``alpha=`` with a uniform
            selection, ``drop_last=`` without epochs), or one given in both forms.
    """
    if not given:
        return new
    unknown = sorted(set(given) - LEGACY_KEYWORDS)
    if unknown:
        raise TypeError(f"{who}() got an unexpected keyword argument {unknown[0]!r}")
    aliases = spelled_as or {}
    keys = set(given)

    def said(names: Any) -> list[str]:
        """The keywords of ``names`` that were given, as the caller wrote them."""
        return [aliases.get(k, k) for k in names if k in keys]

    old = sorted(said(given))
    given, new = dict(given), dict(new)

    def taking(names: dict[str, str] | set[str]) -> dict[str, Any]:
        return {(names[k] if isinstance(names, dict) else k): given.pop(k)
                for k in list(given) if k in names}

    def setting(key: str, make: Callable[[], Any], olds: list[str]) -> None:
        """``new[key]``, made from the earlier keywords ``olds``, unless ``key`` was given."""
        if new[key] is not None:
            try:
                fix = f"pass {key}={spelled(make())} (holding them) only"
            except (TypeError, ValueError):  # (they do not even make one: say where they go)
                fix = f"pass {key}= only, with them in the object it takes"
            raise OptionError(f"{key}= was given beside {', '.join(o + '=' for o in olds)}, "
                              f"which now go into it: {fix}")
        new[key] = shown[key] = make()

    shown: dict[str, Any] = {}
    workers = taking(WORKERS)
    if workers:
        setting("workers", lambda: Workers(**workers), said(WORKERS))
        if set(workers) == {"n"}:
            shown["workers"] = workers["n"]
    prioritized, epoch = taking(PRIORITIZED), taking(EPOCH)
    sampler, k = given.pop("sampler", None), given.pop("max_times_sampled", None)
    if sampler is not None or prioritized or epoch or k is not None:
        setting("selection", lambda: selection_of(sampler, prioritized, epoch, k),
                said(SELECTION))
    limit = taking(set(LIMIT))
    if limit:
        setting("limit", lambda: limit_of(limit), said(LIMIT))
    pin = given.pop("pin_memory", None)
    if pin is not None:
        if isinstance(new["output"], Output):
            raise OptionError(f"output={spelled(new['output'])} was given beside pin_memory=, "
                              f"which now goes into it: pass output=Output(kind, "
                              f"pin_memory={pin!r}) only")
        kind = new["output"] if isinstance(new["output"], str) else "numpy"
        new["output"] = shown["output"] = Output(kind, pin_memory=pin)
    prefetch = given.pop("device_prefetch", None)
    if prefetch is not None:
        if new["device"] is None:
            raise OptionError("device_prefetch= needs a device: pass device=Device('cuda', "
                              f"prefetch={prefetch!r})")
        if isinstance(new["device"], Device):
            raise OptionError(f"device={spelled(new['device'])} was given beside "
                              f"device_prefetch=, which now goes into it: pass "
                              f"device=Device(device, prefetch={prefetch!r}) only")
        new["device"] = shown["device"] = Device(new["device"], prefetch)
    spec = given.pop("transform_spec", None)
    if spec is not None:
        if new["transform"] is None:
            raise OptionError("transform_spec= describes a transform's outputs: pass "
                              "transform=Transform(fn, spec=...)")
        if isinstance(new["transform"], Transform):
            raise OptionError("transform=Transform(...) was given beside transform_spec=, "
                              "which now goes into it: pass transform=Transform(fn, spec=...) "
                              "only")
        new["transform"] = shown["transform"] = Transform(new["transform"], spec)
    plan = taking(set(PLAN))
    if plan:
        setting("plan", lambda: Plan(**plan), said(PLAN))
    written = ", ".join(f"{key}={spelled(value)}" for key, value in shown.items())
    first = "cluster" if who == "ClusterSampler" else "buffer"
    warnings.warn(
        f"{who}({', '.join(k + '=' for k in old)}) is deprecated and goes in the next "
        f"release: write {who}({first}, batch_size, {written}) (Workers, Output, Device "
        f"and Transform from workers.config; strategies from workers.selection; RateLimit "
        f"from shmbuf; Plan from shmbuf.sampling)", DeprecationWarning,
        stacklevel=callers_level())
    return new


def beta_schedule(beta: Any) -> Callable[[int], float]:
    """beta as a function of batches delivered (``Prioritized.beta``'s forms)."""
    return Prioritized(beta=beta).beta_at


def _checked_ratio(limit: RateLimit, batch_size: int) -> RateLimit | None:
    """The pool's ratio limit (None without one), refused where samplers or writers could
    end up waiting for each other."""
    ratio, tolerance = limit.samples_per_insert, limit.tolerance
    if ratio is None:
        return None
    if tolerance < batch_size:
        raise ValueError(
            f"RateLimit tolerance {tolerance:g} is smaller than batch_size {batch_size}: "
            f"samplers could never take a whole batch. Fix: a tolerance of at least a few "
            f"batches, e.g. RateLimit({limit.min_size}, {ratio:g}, {4 * batch_size})")
    if tolerance < ratio:
        raise ValueError(
            f"RateLimit tolerance {tolerance:g} is smaller than samples_per_insert {ratio:g}: "
            f"one insert moves the balance by {ratio:g} samples, so writers and samplers could "
            f"end up waiting for each other (Reverb refuses this too). Fix: a tolerance of at "
            f"least the ratio, e.g. RateLimit({limit.min_size}, {ratio:g}, "
            f"{max(ratio, 4 * batch_size):g})")
    return limit


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
