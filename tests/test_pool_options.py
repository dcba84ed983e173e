"""``SamplerPool``'s options as objects, and the shims that keep the earlier keywords working.

What is proved here:
- every strategy and option object (``Workers``, ``Output``, ``Device``, ``Transform``,
  ``Uniform``, ``Prioritized``, ``Counted``, ``Queue``, ``Epoch``, ``RateLimit``, ``Plan``)
  refuses bad input when it is made, with a typed error naming the field, the value and the
  fix; what only a pool can judge (a ratio against the batch size, a queue with a ratio) is
  refused by the pool, before anything is made;
- ``SamplerPool`` takes at most 12 parameters besides ``**deprecated``;
- each earlier keyword builds the same ``PoolConfig`` as the new form, with exactly one
  ``DeprecationWarning`` attributed to the caller's line, whose suggested spelling, evaluated,
  builds that same config again;
- the issue's example (``alpha=``, ``eps=``, ``drop_last=``, ``priority_eta=`` on a uniform
  pool) is an ``OptionError`` that changes nothing: no segment, no process, the limiter
  untouched; so is an option given in both forms; an unknown keyword is a plain ``TypeError``;
- ``limit=RateLimit(...)`` is honoured (a ratio pool holds the buffer's limiter: a second one
  is refused; ``min_size`` holds sampling back) and the ``selection`` shorthands are their
  objects;
- ``ClusterSampler``'s options (``_cluster_options``) the same way, without Ray's cluster; one
  test (``ray``) opens the legacy and the new form on a local 3-node cluster.

Every pool here samples in-process (``workers=0``): no process is started.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import threading
import warnings
from typing import Any

import multiprocess
import numpy as np
import pytest

import shmbuf
from shmbuf import RateLimit
from shmbuf.sampling import Plan
from tests import pool_procs as procs
from workers import SamplerPool
from workers.config import Device, Output, Transform, Workers
from workers.errors import OptionError
from workers.selection import (
    SHORTHANDS,
    Counted,
    Epoch,
    Prioritized,
    Queue,
    Uniform,
    selection_spec,
)

pytestmark = pytest.mark.timeout(60)

B = 8
DEPRECATED = "is deprecated and goes in the next release"


@pytest.fixture
def buf():
    with procs.new_buffer(capacity=32, lanes=1) as b:
        yield b


def keep_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return batch


# --------------------------------------------------------------------------------------------
# Each object checks its own options
# --------------------------------------------------------------------------------------------
def _unpicklable() -> Any:
    lock = threading.Lock()
    return lambda batch: (lock, batch)[1]


# (what makes the object, the error's type, what its message must say: field, value, fix)
BAD_OBJECTS = {
    "Workers n<0": (lambda: Workers(n=-1), ValueError,
                    r"Workers\(n=-1\): n must be an int in \[0, 64\]"),
    "Workers n float": (lambda: Workers(n=2.5), ValueError,
                        r"Workers\(n=2\.5\): n must be an int in \[0, 64\]"),
    "Workers start_method": (lambda: Workers(2, start_method="thread"), ValueError,
                             r"Workers\(start_method='thread'\): use 'fork', 'forkserver' or "
                             r"'spawn'"),
    "Workers restarts": (lambda: Workers(2, max_restarts_per_minute=-1.0), ValueError,
                         r"Workers\(max_restarts_per_minute=-1\.0\) must be >= 0"),
    "Workers restarts nan": (lambda: Workers(2, max_restarts_per_minute=math.nan), ValueError,
                             r"Workers\(max_restarts_per_minute=nan\) must be >= 0"),
    "Workers staging": (lambda: Workers(2, staging=2), ValueError,
                        r"Workers\(staging=2\): at least n \+ 1 = 3 slots"),
    "Workers ordered": (lambda: Workers(2, ordered="yes"), TypeError,
                        r"Workers\(ordered='yes'\): ordered must be a bool"),
    "Output kind": (lambda: Output("tensorflow"), ValueError,
                    r"Output\('tensorflow'\): the kind is 'numpy', 'torch' or 'jax'"),
    "Output pin_memory": (lambda: Output("torch", pin_memory="yes"), TypeError,
                          r"Output\(pin_memory='yes'\) must be a bool"),
    "Device prefetch": (lambda: Device("cuda", prefetch=0), ValueError,
                        r"Device\(prefetch=\.\.\.\) must be a positive int, got 0"),
    "Transform fn": (lambda: Transform(3), TypeError,
                     r"Transform\(fn=3\): transform must be callable, got int \(pass "
                     r"fn\(batch: dict\) -> dict\)"),
    "Transform spec": (lambda: Transform(keep_batch, spec=[("obs", (2,), "f4")]), TypeError,
                       r"Transform\(spec=\[.*\]\): spec is the outputs as \{name: "
                       r"\(shape_without_batch, dtype\)\}"),
    "Transform unpicklable": (lambda: Transform(_unpicklable()), TypeError,
                              r"cannot be serialised for the worker processes .*Fix: avoid "
                              r"capturing unpicklable objects"),
    "Prioritized alpha nan": (lambda: Prioritized(alpha=math.nan), ValueError,
                              r"Prioritized\(alpha=nan\): alpha must be a finite number >= 0"),
    "Prioritized eps<0": (lambda: Prioritized(eps=-5.0), ValueError,
                          r"Prioritized\(eps=-5\.0\): eps must be a finite number >= 0"),
    "Prioritized beta>1": (lambda: Prioritized(beta=1.5), ValueError,
                           r"Prioritized\(beta=1\.5\): beta must be in \[0, 1\] \(or a "
                           r"schedule\)"),
    "Prioritized schedule": (lambda: Prioritized(beta=(0.4, 1.0)), ValueError,
                             r"Prioritized\(beta=\(0\.4, 1\.0\)\): a schedule is \(start, end, "
                             r"n_batches\)"),
    "Prioritized eta": (lambda: Prioritized(eta=2.0), ValueError,
                        r"Prioritized\(eta=2\.0\): eta must be in \[0, 1\] \(R2D2 uses 0\.9\)"),
    "Counted k": (lambda: Counted(0), ValueError,
                  r"Counted\(k=0\): k must be a positive int \(how many times a row may be "
                  r"delivered\)"),
    "Counted of": (lambda: Counted(2, Queue()), TypeError,
                   r"Counted\(of=Queue\(\)\): counts rows drawn by Uniform\(\) or "
                   r"Prioritized\(\.\.\.\)"),
    "Epoch carry": (lambda: Epoch(carry_remainder=True), ValueError,
                    r"Epoch\(carry_remainder=True\) carries .* pass drop_last=False with it"),
    "Epoch drop_last": (lambda: Epoch(drop_last="no"), TypeError,
                        r"Epoch\(drop_last='no'\): drop_last must be a bool"),
    "RateLimit min_size": (lambda: RateLimit(0), ValueError, r"min_size must be >= 1, got 0"),
    "RateLimit ratio": (lambda: RateLimit(1, -2.0, 64), ValueError,
                        r"samples_per_insert ratio must be finite and > 0, got -2\.0"),
    "RateLimit tolerance": (lambda: RateLimit(1, 2.0, math.nan), ValueError,
                            r"samples_per_insert tolerance must be >= 0, got nan"),
    "Plan sequence_length": (lambda: Plan(sequence_length=0), ValueError,
                             r"sequence_length must be an int >= 1, got 0"),
    "Plan sequences and n-step": (lambda: Plan(sequence_length=4, n_step=2), ValueError,
                                  r"sequence_length cannot be combined with n_step or "
                                  r"frame_lookahead.*Accumulate returns in the learner"),
}


@pytest.mark.parametrize("name", list(BAD_OBJECTS))
def test_each_option_object_refuses_bad_input_naming_field_value_and_fix(name):
    make, error, message = BAD_OBJECTS[name]
    with pytest.raises(error, match=message) as info:
        make()
    assert type(info.value) is error  # the type the message is about, not a subclass


# What a pool refuses of objects that are fine alone: checked against the batch size, the
# plan and the buffer, before a segment or a process exists.
BAD_COMBINATIONS = {
    "tolerance < batch": (dict(limit=RateLimit(1, 2.0, 4)), ValueError,
                          r"RateLimit tolerance 4 is smaller than batch_size 8: .* Fix: a "
                          r"tolerance of at least a few batches, e\.g\. RateLimit\(1, 2, 32\)"),
    "tolerance < ratio": (dict(limit=RateLimit(1, 16.0, 8)), ValueError,
                          r"RateLimit tolerance 8 is smaller than samples_per_insert 16: .* "
                          r"Fix: .* RateLimit\(1, 16, 32\)"),
    "queue with a ratio": (dict(selection=Queue(), limit=RateLimit(1, 1.0, 64)), ValueError,
                           r"Queue\(\) is its own rate limiter .* pass "
                           r"limit=RateLimit\(min_size=\.\.\.\) without samples_per_insert"),
    "counted sequences": (dict(selection=Counted(2), plan=Plan(sequence_length=4)), ValueError,
                          r"Counted\(2\) delivers single stored transitions; .* sample with "
                          r"Uniform\(\) or Prioritized\(\)"),
    "jax on a device": (dict(output="jax", device="cpu"), ValueError,
                        r"device= delivers torch tensors; drop output='jax'"),
    "workers<0": (dict(workers=-1), ValueError, r"Workers\(n=-1\): n must be an int"),
    "workers str": (dict(workers="2"), TypeError,
                    r"workers='2': pass a number of processes or Workers\(\.\.\.\)"),
    "output kind": (dict(output="tensorflow"), ValueError, r"Output\('tensorflow'\)"),
    "output type": (dict(output=3), TypeError,
                    r"output=3: pass 'numpy', 'torch', 'jax' or Output\(\.\.\.\)"),
    "selection name": (dict(selection="rank"), TypeError,
                       r"selection='rank' is not a selection strategy: pass Uniform\(\), .* "
                       r"\['epoch', 'prioritized', 'queue', 'uniform'\]"),
    "limit tuple": (dict(limit=(8.0, 64)), TypeError,
                    r"limit=\(8\.0, 64\): pass shmbuf\.RateLimit\(min_size, samples_per_insert, "
                    r"tolerance\)"),
    "plan dict": (dict(plan={"sequence_length": 4}), TypeError,
                  r"plan=\{'sequence_length': 4\}: pass shmbuf\.sampling\.Plan\(\.\.\.\)"),
}


@pytest.mark.parametrize("name", list(BAD_COMBINATIONS))
def test_a_pool_refuses_what_its_options_cannot_do_together_before_making_anything(
        buf, own_shm_entries, name):
    kwargs, error, message = BAD_COMBINATIONS[name]
    before, limiter = own_shm_entries(), buf.storage.limiter.stats()
    with pytest.raises(error, match=message):
        SamplerPool(buf, B, **{"workers": 0, **kwargs})
    assert own_shm_entries() == before and buf.storage.limiter.stats() == limiter
    buf.storage.limiter.take().close()  # nobody holds it


# --------------------------------------------------------------------------------------------
# The signature
# --------------------------------------------------------------------------------------------
def test_sampler_pool_takes_at_most_12_parameters_besides_deprecated():
    params = list(inspect.signature(SamplerPool).parameters.values())
    var_keyword = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    assert [p.name for p in var_keyword] == ["deprecated"]
    named = [p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(named) <= 12, named
    assert named[:2] == ["buffer", "batch_size"]
    keyword_only = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert {"selection", "limit", "plan", "workers", "output", "device", "transform"} \
        <= keyword_only


# --------------------------------------------------------------------------------------------
# The earlier keywords: the same config, one warning at the caller's line
# --------------------------------------------------------------------------------------------
SPEC = {"obs": ((2, 3), "float32")}  # a transform_spec (the buffer's obs is (2, 3) float32)

# (the earlier keywords, the new form): both given to SamplerPool(buf, 8, seed=7, ...)
LEGACY = {
    "n_workers": (dict(n_workers=0), dict(workers=0)),
    "worker options": (dict(n_workers=0, n_staging=3, ordered=True, max_restarts_per_minute=5),
                       dict(workers=Workers(0, staging=3, ordered=True,
                                            max_restarts_per_minute=5))),
    "start_method": (dict(n_workers=0, start_method="spawn"),
                     dict(workers=Workers(0, start_method="spawn"))),
    "prioritized": (dict(n_workers=0, sampler="prioritized", alpha=0.3, beta=(0.4, 1.0, 100),
                         eps=1e-3, priority_eta=0.5),
                    dict(workers=0, selection=Prioritized(alpha=0.3, beta=(0.4, 1.0, 100),
                                                          eps=1e-3, eta=0.5))),
    "uniform": (dict(n_workers=0, sampler="uniform"), dict(workers=0, selection=Uniform())),
    "queue": (dict(n_workers=0, sampler="queue"), dict(workers=0, selection=Queue())),
    "epoch": (dict(n_workers=0, sampler="epoch", drop_last=False, carry_remainder=True),
              dict(workers=0, selection=Epoch(drop_last=False, carry_remainder=True))),
    "counted": (dict(n_workers=0, max_times_sampled=3), dict(workers=0, selection=Counted(3))),
    "counted prioritized": (dict(n_workers=0, sampler="prioritized", alpha=0.5,
                                 max_times_sampled=2),
                            dict(workers=0, selection=Counted(2, Prioritized(alpha=0.5)))),
    "min_size": (dict(n_workers=0, min_size=4), dict(workers=0, limit=RateLimit(4))),
    "ratio": (dict(n_workers=0, min_size=4, samples_per_insert=(2.0, 64)),
              dict(workers=0, limit=RateLimit(4, 2.0, 64))),
    "plan": (dict(n_workers=0, sequence_length=3, cross_episodes=True),
             dict(workers=0, plan=Plan(sequence_length=3, cross_episodes=True))),
    "transform_spec": (dict(n_workers=0, transform=keep_batch, transform_spec=SPEC),
                       dict(workers=0, transform=Transform(keep_batch, spec=SPEC))),
    "pin_memory": (dict(n_workers=0, output="torch", pin_memory=False),
                   dict(workers=0, output=Output("torch", pin_memory=False))),
    "device_prefetch": (dict(n_workers=0, device="cpu", device_prefetch=3),
                        dict(workers=0, device=Device("cpu", prefetch=3))),
}
NEEDS_TORCH = {"pin_memory", "device_prefetch"}
# What the warning's suggested spelling may name (it says where each comes from).
SPELLING = {"Workers": Workers, "Output": Output, "Device": Device, "Transform": Transform,
            "Uniform": Uniform, "Prioritized": Prioritized, "Counted": Counted, "Queue": Queue,
            "Epoch": Epoch, "RateLimit": RateLimit, "Plan": Plan, "fn": keep_batch}


def _config(pool: SamplerPool) -> dict[str, Any]:
    """The pool's ``PoolConfig`` as comparable values (the seed as its entropy and key)."""
    cfg = {f.name: getattr(pool._config, f.name) for f in dataclasses.fields(pool._config)}
    seed = cfg.pop("seed")
    cfg["seed"] = (seed.entropy, seed.spawn_key)
    return cfg


def _config_of(buf: shmbuf.ReplayBuffer, **kwargs: Any) -> dict[str, Any]:
    with SamplerPool(buf, B, seed=7, **kwargs) as pool:
        return _config(pool)


@pytest.mark.parametrize("case", list(LEGACY))
def test_earlier_keywords_build_the_new_forms_config_with_one_warning_at_the_callers_line(
        buf, case):
    if case in NEEDS_TORCH:
        pytest.importorskip("torch")
    legacy, new = LEGACY[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form warns of nothing
        expected = _config_of(buf, **new)
    with pytest.warns(DeprecationWarning) as record:
        line = inspect.currentframe().f_lineno + 1
        with SamplerPool(buf, B, seed=7, **legacy) as pool:
            got = _config(pool)
    assert got == expected
    deprecations = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in deprecations]
    warning = deprecations[0]
    assert (warning.filename, warning.lineno) == (__file__, line)  # the caller's own line
    message = str(warning.message)
    olds = sorted(k for k in legacy if k not in ("output", "device", "transform"))
    assert message.startswith(f"SamplerPool({', '.join(k + '=' for k in olds)}) {DEPRECATED}: "
                              f"write SamplerPool(buffer, batch_size, ")
    spelled = re.search(r"write SamplerPool\(buffer, batch_size, (.*)\) \(Workers, Output",
                        message).group(1)
    suggested = eval(f"dict({spelled})", {}, SPELLING)  # noqa: S307 - our own message
    as_written = {k: v for k, v in legacy.items() if k in ("output", "device", "transform")}
    assert _config_of(buf, **{**as_written, **suggested}) == expected


def test_the_issues_example_is_an_option_error_that_changes_nothing(buf, own_shm_entries):
    """``alpha``/``eps``/``priority_eta`` and ``drop_last`` on a uniform pool were silently
    ignored; now every one of them is named with the object that takes it, before the buffer
    is attached (a name that attaches nothing shows it), and nothing is made."""
    before, limiter = own_shm_entries(), buf.storage.limiter.stats()
    for target in (buf, "shmbuf-no-such-buffer"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # refused before any warning: nothing to migrate
            with pytest.raises(OptionError) as info:
                SamplerPool(target, 8, n_workers=0, alpha=0.1, eps=-5.0, drop_last=False,
                            priority_eta=0.5)
        message = str(info.value)
        assert "alpha, eps, priority_eta belong to prioritized sampling (selection=" \
               "Prioritized(alpha=0.1, eps=-5.0, eta=0.5))" in message
        assert "drop_last belongs to epochs (selection=Epoch(drop_last=False))" in message
        assert "not to sampler='uniform': pass the object that takes them, or drop them" \
            in message
    assert isinstance(info.value, shmbuf.ShmbufError) and isinstance(info.value, TypeError)
    assert own_shm_entries() == before
    assert buf.storage.limiter.stats() == limiter
    buf.storage.limiter.take().close()  # the limiter is free: nobody took it
    assert not multiprocess.active_children()


@pytest.mark.parametrize("kwargs, message", [
    (dict(workers=2, n_workers=2), r"workers= was given beside n_workers=, which now go into "
                                   r"it: pass workers=Workers\(n=2\) \(holding them\) only"),
    (dict(workers=Workers(2), start_method="fork"),
     r"workers= was given beside start_method=.*pass workers=Workers\("),
    (dict(selection=Queue(), sampler="queue"), r"selection= was given beside sampler="),
    (dict(selection=Prioritized(), alpha=0.3), r"selection= was given beside alpha=, which now "
                                               r"go into it: pass selection= only, with them "
                                               r"in the object it takes"),
    (dict(selection=Queue(), sampler="prioritized", alpha=0.3, priority_eta=0.5),
     r"selection= was given beside sampler=, alpha=, priority_eta=, which now go into it: pass "
     r"selection=Prioritized\(alpha=0\.3, eta=0\.5\) \(holding them\) only"),
    (dict(limit=RateLimit(4), min_size=4), r"limit= was given beside min_size="),
    (dict(plan=Plan(sequence_length=2), sequence_length=2),
     r"plan= was given beside sequence_length=.*pass plan=Plan\(sequence_length=2\)"),
    (dict(output=Output("torch"), pin_memory=True),
     r"output=Output\(kind='torch'\) was given beside pin_memory=.* "
     r"output=Output\(kind, pin_memory=True\) only"),
    (dict(device=Device("cpu"), device_prefetch=3),
     r"device=Device\(device='cpu'\) was given beside device_prefetch=.*prefetch=3\) only"),
    (dict(transform=Transform(keep_batch), transform_spec=SPEC),
     r"transform=Transform\(\.\.\.\) was given beside transform_spec=.* "
     r"transform=Transform\(fn, spec=\.\.\.\) only"),
], ids=["workers", "start_method", "sampler", "alpha", "prioritized", "min_size", "plan",
        "pin_memory", "device_prefetch", "transform_spec"])
def test_an_option_given_in_both_forms_is_an_option_error(buf, own_shm_entries, kwargs,
                                                          message):
    before = own_shm_entries()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(OptionError, match=message):
            SamplerPool(buf, B, **kwargs)
        with pytest.raises(OptionError, match=message):  # before the buffer is attached
            SamplerPool("shmbuf-no-such-buffer", B, **kwargs)
    assert own_shm_entries() == before and not multiprocess.active_children()


@pytest.mark.parametrize("kwargs, name", [
    (dict(workers=0, n_wrokers=2), "n_wrokers"),
    (dict(workers=0, selections=Queue()), "selections"),
    (dict(workers=0, prefetch=2), "prefetch"),
])
def test_an_unknown_keyword_is_a_plain_type_error(buf, kwargs, name):
    with pytest.raises(TypeError) as info:
        SamplerPool(buf, B, **kwargs)
    assert type(info.value) is TypeError  # not an OptionError: no release took it
    assert str(info.value) == f"SamplerPool() got an unexpected keyword argument {name!r}"


# --------------------------------------------------------------------------------------------
# limit= and the selection shorthands
# --------------------------------------------------------------------------------------------
def test_a_ratio_limit_takes_the_buffers_limiter_and_min_size_holds_sampling_back(buf):
    with SamplerPool(buf, B, workers=0, limit=RateLimit(16, 1.0, 16)) as pool:
        stats = buf.storage.limiter.stats()
        assert stats["active"]
        assert (stats["min_size"], stats["samples_per_insert"], stats["tolerance"]) == (
            16, 1.0, 16.0)
        with pytest.raises(shmbuf.ShmbufError, match="already rate-limits"):
            SamplerPool(buf, B, workers=0, limit=RateLimit(1, 2.0, 16))
        with SamplerPool(buf, B, workers=0, limit=RateLimit(16)) as beside:  # no ratio: free
            procs.assert_batch_ok(beside.next(timeout=5), B)
        procs.assert_batch_ok(pool.next(timeout=5), B)
    assert not buf.storage.limiter.stats()["active"]  # lifted at close
    with SamplerPool(buf, B, workers=0, limit=RateLimit(33)) as starved:  # 32 rows held
        with pytest.raises(shmbuf.Timeout, match="holds 32 of min_size=33"):
            starved.next(timeout=0.3)
    with SamplerPool(buf, B, workers=0, limit=RateLimit(1, 1.0, 16)):  # free again
        pass


@pytest.mark.parametrize("name", sorted(SHORTHANDS))
def test_a_selection_shorthand_is_its_strategy_with_the_defaults(buf, name):
    assert selection_spec(name) == SHORTHANDS[name]() == selection_spec(SHORTHANDS[name]())
    with SamplerPool(buf, B, workers=0, selection=name) as short:
        spec = short._config.selection
    with SamplerPool(buf, B, workers=0, selection=SHORTHANDS[name]()) as full:
        assert type(spec) is type(full._config.selection) and spec == full._config.selection
    assert selection_spec("queue") == Queue() and selection_spec(None) == Uniform()


# --------------------------------------------------------------------------------------------
# ClusterSampler: the same options, checked without Ray's cluster
# --------------------------------------------------------------------------------------------
def _cluster_options() -> Any:
    pytest.importorskip("ray")  # (workers.cluster.sampler imports it; no cluster is started)
    from workers.cluster.sampler import _cluster_options

    return _cluster_options


def test_cluster_earlier_keywords_build_the_new_forms_options_with_one_warning():
    options = _cluster_options()
    new = options({}, Prioritized(alpha=0.3, beta=0.5, eps=1e-3),
                  RateLimit(10, 2.0, 64), None, Workers(2, start_method="spawn"))
    assert new == (Prioritized(alpha=0.3, beta=0.5, eps=1e-3), RateLimit(10, 2.0, 64), None,
                   Workers(2, start_method="spawn"))
    legacy = dict(sampler="prioritized", alpha=0.3, beta=0.5, eps=1e-3, min_size=10,
                  samples_per_insert=(2.0, 64), workers_per_node=2, start_method="spawn")
    with pytest.warns(DeprecationWarning) as record:
        line = inspect.currentframe().f_lineno + 1
        got = options(legacy, None, None, None, None)
    assert got == new
    deprecations = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1
    assert (deprecations[0].filename, deprecations[0].lineno) == (__file__, line)
    message = str(deprecations[0].message)
    assert message.startswith(f"ClusterSampler({', '.join(k + '=' for k in sorted(legacy))}) "
                              f"{DEPRECATED}: write ClusterSampler(cluster, batch_size, ")
    spelled = re.search(r"batch_size, (.*)\) \(Workers", message).group(1)
    assert options({}, **{"selection": None, "limit": None, "plan": None, "workers": None,
                          **eval(f"dict({spelled})", {}, SPELLING)}) == new  # noqa: S307


def test_cluster_options_refuse_what_the_cluster_does_not_take():
    options = _cluster_options()
    assert options({}, "queue", None, None, None) == (
        Queue(), None, None, Workers(1, start_method="forkserver"))
    assert options({}, None, None, None, 3)[3] == Workers(3, start_method="forkserver")
    assert options({}, "epoch", None, Plan(sequence_length=4), None)[:3] == (
        Epoch(), None, Plan(sequence_length=4))
    with pytest.raises(OptionError, match="selection= was given beside sampler="):
        options({"sampler": "queue"}, Queue(), None, None, None)
    with pytest.raises(OptionError, match=r"workers= was given beside workers_per_node=, which "
                                          r"now go into it: pass workers=Workers\(n=2\)"):
        options({"workers_per_node": 2}, None, None, None, 2)
    with pytest.raises(OptionError, match=r"alpha belongs to prioritized sampling"):
        options({"alpha": 0.3}, None, None, None, None)
    with pytest.raises(ValueError, match=r"Queue\(\) delivers single stored transitions"):
        options({}, Queue(), None, Plan(frame_stack=4), None)
    with pytest.raises(TypeError, match=r"plan=\{'sequence_length': 4\}: pass a "
                                        r"shmbuf.sampling.Plan"):
        options({}, None, None, {"sequence_length": 4}, None)
    with pytest.raises(TypeError) as info:
        options({"sequence_length": 4}, None, None, None, None)
    assert type(info.value) is TypeError
    assert str(info.value) == ("ClusterSampler() got an unexpected keyword argument "
                               "'sequence_length'")
    with pytest.raises(ValueError, match=r"selection=Counted\(.*\): a cluster samples with "
                                         r"Uniform\(\), Prioritized\(\.\.\.\), Queue\(\) "
                                         r"or Epoch\(\.\.\.\)"):
        options({}, Counted(2), None, None, None)


class _Stop(Exception):
    pass


class _NoCluster:
    """Enough of a ``ReplayCluster`` for ``ReplayCluster.sampler`` to reach the sampler's
    option checks; reading its ``spec`` (the next step) stops the construction, so nothing
    is started and no Ray cluster is needed."""

    _samplers: list[Any] = []

    def _check_open(self) -> None:
        pass

    @property
    def spec(self) -> Any:
        raise _Stop


def test_cluster_sampler_warns_at_the_line_that_calls_cluster_sampler():
    """Through ``ReplayCluster.sampler`` and ``ClusterSampler.__init__`` (frames of the
    ``workers`` package), the warning still names the user's line: Python's default filter
    shows a ``DeprecationWarning`` only where ``__main__`` triggers it."""
    pytest.importorskip("ray")
    from workers.cluster import ReplayCluster

    with pytest.warns(DeprecationWarning) as record, pytest.raises(_Stop):
        line = inspect.currentframe().f_lineno + 1
        ReplayCluster.sampler(_NoCluster(), 8, sampler="queue")
    (warning,) = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)
    assert "write ClusterSampler(cluster, batch_size, selection=Queue())" in str(warning.message)


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_cluster_sampler_of_the_earlier_keywords_equals_the_new_form_on_ray(nodes):
    from workers.cluster import ReplayCluster

    with ReplayCluster(procs.SPEC, capacity_per_node=64, nodes=nodes) as cluster:
        with pytest.warns(DeprecationWarning, match=DEPRECATED):
            old = cluster.sampler(8, sampler="prioritized", alpha=0.5, min_size=2,
                                  workers_per_node=1, seed=0)
        with old:
            settings = (old.selection, old.sampler, old.min_size, old.limit)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with cluster.sampler(8, selection=Prioritized(alpha=0.5), limit=RateLimit(2),
                                 workers=1, seed=0) as new:
                assert (new.selection, new.sampler, new.min_size, new.limit) == settings
    assert settings == (Prioritized(alpha=0.5), "prioritized", 2, None)
