"""The conftest of SB3's own test suite for the conformance run: every test runs twice in one
session, ``[impl=sb3]`` with SB3's replay buffers (the control) and ``[impl=shmbuf]`` with
``shmbuf.integrations.sb3``'s swapped in, and every outcome goes to a JSON file.

``tests/conformance/sb3_suite.py`` copies this file as ``conftest.py`` into the ``tests/`` of
SB3's unpacked sdist; nothing of SB3's code is kept in this repository.

The swap, for one test at a time (undone at its teardown), reaches each way a test gets a
replay buffer class: the off-policy algorithms' default (``OffPolicyAlgorithm._setup_model``
picks shmbuf's ``ReplayBuffer`` or ``DictReplayBuffer`` where SB3 would pick its own), the names
the test module imported, and any test argument that is one of SB3's two classes
(``@pytest.mark.parametrize("replay_buffer_cls", [ReplayBuffer, ...])`` captured them at
import). SB3's own modules keep their names: SB3's classes refer to them
(``super(ReplayBuffer, self)`` in ``DictReplayBuffer``, which ``HerReplayBuffer`` subclasses),
and ``NStepReplayBuffer`` and ``HerReplayBuffer`` are not replaced. Every shmbuf buffer a test
made is closed at its teardown, so its segment does not outlive the test.

Both runs use one torch thread (small networks train faster so on a shared 2-core machine).

Environment: ``SHMBUF_CONFORMANCE_RESULTS`` names the JSON file written at the session's end
(``{"version": ..., "results": [{"test": id without the impl, "impl": ..., "outcome": ...,
"message": ..., "buffers": shmbuf buffers the test made}]}``).
"""

from __future__ import annotations

import json
import os
import weakref

import pytest
import stable_baselines3
import torch
from gymnasium import spaces
from stable_baselines3.common import buffers as sb3_buffers
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm

from shmbuf.integrations import sb3 as ours

torch.set_num_threads(1)
IMPLS = ("sb3", "shmbuf")
SWAPPED = {sb3_buffers.ReplayBuffer: ours.ReplayBuffer,
           sb3_buffers.DictReplayBuffer: ours.DictReplayBuffer}
_made: weakref.WeakSet = weakref.WeakSet()  # shmbuf buffers made by the running test
_results: dict[tuple[str, str], dict] = {}
_buffers_made: dict[str, int] = {}  # test id -> shmbuf buffers it made (proof of the swap)
_opened = [0]  # shmbuf buffers made by the running test (_made forgets those collected)

_open = ours._SharedReplay._open


def _open_and_track(self, *args, **kwargs):
    _open(self, *args, **kwargs)
    _made.add(self)
    _opened[0] += 1


ours._SharedReplay._open = _open_and_track  # type: ignore[method-assign]


_setup_model = OffPolicyAlgorithm._setup_model


def _setup_model_with_shmbufs_default(self) -> None:
    """SB3's default choice (``_setup_model``), made with shmbuf's classes: a Dict space gets
    ``DictReplayBuffer``, ``n_steps == 1`` ``ReplayBuffer``; n-step returns keep SB3's own."""
    if self.replay_buffer_class is None and self.n_steps == 1:
        self.replay_buffer_class = (ours.DictReplayBuffer
                                    if isinstance(self.observation_space, spaces.Dict)
                                    else ours.ReplayBuffer)
    _setup_model(self)


@pytest.fixture(autouse=True, params=IMPLS, ids=[f"impl={i}" for i in IMPLS])
def buffer_impl(request, monkeypatch):
    """SB3's classes (``sb3``) or shmbuf's in their place (``shmbuf``) for this test."""
    _opened[0] = 0
    if request.param == "shmbuf":
        monkeypatch.setattr(OffPolicyAlgorithm, "_setup_model", _setup_model_with_shmbufs_default)
        for name, value in list(vars(request.module).items()):
            if isinstance(value, type) and value in SWAPPED:
                monkeypatch.setattr(request.module, name, SWAPPED[value])
    yield request.param
    _buffers_made[request.node.nodeid] = _opened[0]
    for buffer in list(_made):
        buffer.close()
    _made.clear()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """Arguments captured at import (parametrize values) get shmbuf's classes too."""
    if _impl(item) == "shmbuf":
        for name, value in list(item.funcargs.items()):
            if isinstance(value, type) and value in SWAPPED:
                item.funcargs[name] = SWAPPED[value]


def _impl(item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get("buffer_impl")


def _base_id(nodeid: str, impl: str) -> str:
    token = f"impl={impl}"
    for old, new in ((f"[{token}]", ""), (f"[{token}-", "["), (f"-{token}]", "]"),
                     (f"-{token}-", "-")):
        nodeid = nodeid.replace(old, new)
    return nodeid


def pytest_runtest_logreport(report):
    impl = next((i for i in IMPLS if f"impl={i}" in report.nodeid), None)
    if impl is None:
        return
    key = (_base_id(report.nodeid, impl), impl)
    entry = _results.setdefault(key, {"outcome": "passed", "message": "", "buffers": 0})
    if report.when == "teardown":
        entry["buffers"] = _buffers_made.pop(report.nodeid, 0)
    if report.failed:
        entry["outcome"] = "failed"
        entry["message"] = entry["message"] or (report.longreprtext or "").strip()[-2000:]
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_sessionfinish(session):
    path = os.environ.get("SHMBUF_CONFORMANCE_RESULTS")
    if not path:
        return
    results = [{"test": test, "impl": impl, **entry}
               for (test, impl), entry in sorted(_results.items())]
    with open(path, "w") as f:
        json.dump({"version": stable_baselines3.__version__, "results": results}, f, indent=1)
