"""Issue 28's moves keep the old import paths for one release: each old module is a shim that
warns once, with a ``DeprecationWarning`` naming the new path (a message the suite's filter turns
into an error, so nothing of ours imports them), and gives the new module's names, the very
same objects. The packages that replace modules of the same name (``workers.cluster``,
``workers.delivery``, ``workers.demo``) export what those modules did, without a warning; the
errors moved to ``workers.errors`` are still importable where they were exported; the staging
ring's stats words left ``shmbuf.layout`` for ``workers.staging``.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

# old module -> new module; the shim is the new module itself (sys.modules maps the old name)
ALIASES = {
    "workers.delivery_ring": "workers.delivery.ring",
    "workers.delivery_local": "workers.delivery.local",
    "workers.delivery_device": "workers.delivery.device",
    "workers.delivery_jax": "workers.delivery.jax",
    "workers.delivery_pinned": "workers.delivery.pinned",
    "workers.delivery_layers": "workers.delivery.layers",
    "workers.demo_line": "workers.demo.line",
    "workers.plot": "workers.demo.plot",
    "workers.envs": "workers.demo.envs",
    "shmbuf.fill": "shmbuf.imitation",
}
RAY_ALIASES = {  # workers.cluster imports ray
    "workers.cluster_actors": "workers.cluster.actors",
    "workers.cluster_batch": "workers.cluster.batch",
    "workers.cluster_host": "workers.cluster.host",
    "workers.cluster_rate": "workers.cluster.rate",
    "workers.cluster_sampler": "workers.cluster.sampler",
    "workers.cluster_sources": "workers.cluster.sources",
    "workers.cluster_demo": "workers.demo.ray_nodes",
}


def import_fresh(monkeypatch: pytest.MonkeyPatch, old: str) -> tuple[Any, list[str]]:
    """Import ``old`` as a first import would (its shim runs again), under ``pytest.warns``."""
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning) as record:
        module = importlib.import_module(old)
    return module, [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]


def the_suites_filter_errors_on(message: str) -> bool:
    """Whether pyproject.toml's ``filterwarnings`` makes ``message`` an error in the suite."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    entries = config["tool"]["pytest"]["ini_options"]["filterwarnings"]
    return any(e.startswith("error:") and e.endswith(":DeprecationWarning")
               and re.match(e.split(":")[1], message) for e in entries)


def check_alias(monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    module, messages = import_fresh(monkeypatch, old)
    assert module is importlib.import_module(new)
    assert messages == [f"{old} is deprecated and goes in the next release: import {new}"]
    assert the_suites_filter_errors_on(messages[0])


@pytest.mark.parametrize(("old", "new"), ALIASES.items())
def test_an_old_module_path_warns_and_is_the_new_module(monkeypatch, old, new):
    check_alias(monkeypatch, old, new)


@pytest.mark.parametrize(("old", "new"), RAY_ALIASES.items())
def test_an_old_cluster_module_path_warns_and_is_the_new_module(monkeypatch, old, new):
    pytest.importorskip("ray")
    check_alias(monkeypatch, old, new)


def test_the_old_cluster_nodes_path_still_names_its_errors(monkeypatch):
    """``workers.cluster_nodes`` defined the cluster's errors, which live in ``workers.errors``
    now: its shim reads them from there, and the rest from ``workers.cluster.nodes``."""
    pytest.importorskip("ray")
    from workers import errors
    from workers.cluster import nodes

    old, messages = import_fresh(monkeypatch, "workers.cluster_nodes")
    assert messages == ["workers.cluster_nodes is deprecated and goes in the next release: "
                        "import workers.cluster.nodes"]
    for name in ("NodeLostError", "NodeLostWarning", "NoHostOnNodeError", "HostRestartedWarning"):
        assert getattr(old, name) is getattr(errors, name)
    for name in ("ClusterClient", "current_node_id", "on_node", "NAME_PREFIX"):
        assert getattr(old, name) is getattr(nodes, name)
    assert "ClusterClient" in dir(old)
    with pytest.raises(AttributeError):
        old.no_such_name  # noqa: B018


def test_the_packages_export_what_the_modules_of_their_name_did():
    """``workers.delivery`` and ``workers.demo`` were modules: the packages of the same name
    export their names (no shim is possible, and none warns)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from workers import delivery, demo
        from workers.delivery import base
        from workers.demo import actor_learner, command

    for name in ("Delivery", "DeliveryLayer", "HostDelivery", "PoolParts", "RecentBatches",
                 "device_backend"):
        assert getattr(delivery, name) is getattr(base, name)
    for name in ("register", "main", "add_arguments"):
        assert getattr(demo, name) is getattr(command, name)
    for name in ("run", "env_actor", "train_step", "demo_limits"):
        assert getattr(demo, name) is getattr(actor_learner, name)


def test_the_cluster_package_exports_what_the_cluster_module_did():
    pytest.importorskip("ray")
    from workers import cluster, errors
    from workers.cluster import actors, nodes, replay_cluster, sampler

    assert cluster.ReplayCluster is replay_cluster.ReplayCluster
    assert cluster.ClusterSampler is sampler.ClusterSampler
    assert cluster.ClusterBatch is sampler.ClusterBatch
    assert cluster.ClusterActors is actors.ClusterActors
    assert cluster.ClusterClient is nodes.ClusterClient
    assert cluster.current_node_id is nodes.current_node_id
    for name in ("MainModuleReimportError", "NoHostOnNodeError", "NodeLostError",
                 "NodeLostWarning", "HostRestartedWarning"):
        assert getattr(cluster, name) is getattr(errors, name)
    assert set(cluster.__all__) == {
        "ClusterActorContext", "ClusterActors", "ClusterBatch", "ClusterClient",
        "ClusterSampler", "HostRestartedWarning", "MainModuleReimportError",
        "NoHostOnNodeError", "NodeLostError", "NodeLostWarning", "ReplayCluster",
        "alive_node_ids", "current_node_id", "on_node"}


def test_the_demo_command_is_where_the_entry_point_names_it():
    """``pyproject.toml``'s entry point ``demo = "workers.demo:register"`` and ``python -m
    workers.demo`` still lead to the demo."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["project"]["entry-points"]["shmbuf.commands"]["demo"] == "workers.demo:register"
    from workers import demo
    from workers.demo import command

    assert demo.register is command.register
    out = subprocess.run([sys.executable, "-m", "workers.demo", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--ray-nodes" in out.stdout and "python -m workers.demo" in out.stdout


def test_worker_errors_live_in_workers_errors_and_are_importable_where_they_were():
    """The classes ``shmbuf`` exports stay defined in ``shmbuf.errors`` (``shmbuf`` may not
    import ``workers``); ``workers.errors`` re-exports them and defines ``workers``' own."""
    import shmbuf
    from workers import config, errors, legacy, supervise

    for name in ("WorkerDiedError", "WorkerError", "ActorError", "DeviceUnavailableError"):
        assert getattr(shmbuf, name) is getattr(errors, name)
        assert getattr(shmbuf.errors, name) is getattr(errors, name)
    assert supervise.MainModuleReimportError is errors.MainModuleReimportError
    assert config.OptionError is legacy.OptionError is errors.OptionError
    for name in errors.__all__:
        error = getattr(errors, name)
        assert issubclass(error, shmbuf.ShmbufError) or issubclass(error, RuntimeWarning), name


def test_the_staging_stats_words_moved_to_workers_staging():
    """``shmbuf.layout.STAT_*`` still read, with a warning naming ``workers.staging``; the names
    the ring's layout document lists are the words' names in index order."""
    from shmbuf import layout
    from workers import staging

    names = ["STAT_BATCHES", "STAT_WAIT_NS", "STAT_RESTARTS", "STAT_WORKERS", "STAT_RECLAIMED",
             "STAT_RECLAIMED_BYTES", "STAT_ADOPTED", "STAGING_STATS_LINES"]
    for name in names:
        with pytest.warns(DeprecationWarning, match=f"use workers.staging.{name}") as record:
            assert getattr(layout, name) == getattr(staging, name)
        assert the_suites_filter_errors_on(str(record[0].message))
    assert [getattr(staging, f"STAT_{n.upper()}") for n in staging.STAT_NAMES] == list(
        range(len(staging.STAT_NAMES)))
    assert len(staging.STAT_NAMES) <= staging.STAGING_STATS_LINES * layout.WORDS_PER_LINE
    with pytest.raises(AttributeError, match="STAT_NOPE"):
        layout.STAT_NOPE  # noqa: B018
