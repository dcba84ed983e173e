"""The cluster tests on Ray nodes that share nothing: each node in its own network namespace
(one address on a bridge, no default route), mount namespace (its own /dev/shm and /tmp/ray) and
host name (``workers.cluster.netns``), the learner inside the head node. Each module of
``ISOLATED_MODULES`` runs in a pytest of its own inside the head node (those modules skip their
tests in this run: nothing runs twice), and afterwards every node's own /dev/shm must be empty.
Also: ``shmbuf ls``, ``gc`` and ``top`` on a node see that node's segments only, and the nodes
are isolated and removed even when starting them fails. Needs root; skips with the reason
elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")

from tests._helpers import netns_cluster as nc  # noqa: E402
from tests._helpers.processes import pid_alive  # noqa: E402
from workers.cluster import netns  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(1800)]

MODULE_TIMEOUT = 1500.0  # a whole module on a loaded 2-core machine


@pytest.fixture(scope="module")
def isolated():
    reason = nc.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with nc.make_nodes(3) as nodes:
        yield nodes


def node_shm(nodes: netns.IsolatedNodes) -> dict[int, list[str]]:
    return {n.index: nodes.shm_entries(n.index) for n in nodes.nodes}


@pytest.mark.parametrize("module", nc.ISOLATED_MODULES)
def test_cluster_module_passes_on_isolated_nodes(isolated, module):
    assert not any(node_shm(isolated).values())
    out = nc.run_module(isolated, module, MODULE_TIMEOUT)
    print(out.stdout[-3000:])
    assert out.returncode == 0, f"{module} on isolated nodes:\n{out.stdout[-8000:]}\n" \
                                f"{out.stderr[-3000:]}"
    assert " passed" in out.stdout and " skipped" not in out.stdout.split("\n")[-2], out.stdout
    # Every node's own /dev/shm is as it was: empty (a fresh tmpfs holds nobody else's).
    assert not any(node_shm(isolated).values()), node_shm(isolated)


HOLD_CLUSTER = r"""
import json, sys
import ray
from tests import cluster_procs as cp
from workers.cluster import ReplayCluster, netns

desc = netns.connect(runtime_env={"env_vars": {"PYTHONPATH": sys.argv[1]}})
nodes = [n["node_id"] for n in desc["nodes"] if n["node_id"]]
with ReplayCluster(cp.ROWS.fields, capacity_per_node=64, nodes=nodes) as cluster:
    ray.get([cp.write_rows.options(**cluster.on_node(n)).remote(cluster, k, 1, 10 * (k + 1))
             for k, n in enumerate(nodes)], timeout=120)
    print(json.dumps([cluster.buffer_names[n] for n in nodes]), flush=True)
    sys.stdin.readline()  # until the test has looked at every node
"""


def test_shmbuf_ls_gc_top_on_a_node_see_only_its_segments(isolated):
    learner = subprocess.Popen(
        isolated.learner_command([sys.executable, "-c", HOLD_CLUSTER, nc.ROOT]),
        env=isolated.learner_env(), cwd=nc.ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert learner.stdout is not None and learner.stdin is not None
        line = learner.stdout.readline()
        assert line, learner.stderr.read() if learner.stderr else ""
        names = json.loads(line)
        shmbuf_cli = [os.path.join(os.path.dirname(sys.executable), "shmbuf")]
        for k, name in enumerate(names):
            ls = isolated.run_on(k, [*shmbuf_cli, "ls", "--json"])
            assert ls.returncode == 0, ls.stderr
            listed = {s["name"] for s in json.loads(ls.stdout)}
            assert listed == {name}, (k, listed)  # its own buffer, no other node's
            gc = isolated.run_on(k, [*shmbuf_cli, "gc", "--dry-run"])
            assert gc.returncode == 0 and not any(n in gc.stdout for n in names), gc.stdout
            top = isolated.run_on(k, [*shmbuf_cli, "top", "--once", "--interval", "0.2"])
            assert top.returncode == 0, top.stderr
            assert [n for n in names if n in top.stdout] == [name], top.stdout
        learner.stdin.write("\n")
        learner.stdin.flush()
        assert learner.wait(timeout=120) == 0, learner.stderr.read() if learner.stderr else ""
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait(timeout=30)
    assert not any(node_shm(isolated).values()), node_shm(isolated)


def _ours(tag: str) -> dict[str, list[str]]:
    """What of ``tag``'s nodes the machine still holds: namespaces, links, processes."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {"netns": [ln.split()[0] for ln in ns.splitlines() if tag in ln],
            "links": [ln.split(":")[1].strip() for ln in links.splitlines() if f"sb{tag}" in ln]}


def test_nodes_are_isolated_and_removed_without_a_trace():
    reason = nc.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    nodes = nc.make_nodes(1, spare=1)
    try:
        tag, keepers = nodes.tag, [n.keeper for n in nodes.nodes]
        assert set(_ours(tag)["netns"]) == {n.netns for n in nodes.nodes}
        # Each node: its own address, nothing routed elsewhere, its own host name and /dev/shm.
        for k, n in enumerate(nodes.nodes):
            routes = nodes.run_on(k, ["ip", "route"]).stdout
            assert "default" not in routes and f"{netns.SUBNET}.0/24" in routes, routes
            assert nodes.run_on(k, ["hostname"]).stdout.strip() == n.hostname
        probe = "import os; open('/dev/shm/shmbuf-probe', 'w').close(); print(os.listdir('/dev/shm'))"
        assert nodes.run_on(0, [sys.executable, "-c", probe]).returncode == 0
        assert nodes.shm_entries(0) == ["shmbuf-probe"] and nodes.shm_entries(1) == []
        assert not os.path.exists("/dev/shm/shmbuf-probe")  # not this machine's either
        reach = ("import socket, sys; s = socket.socket(); s.settimeout(3); "
                 "sys.exit(s.connect_ex((sys.argv[1], 6379)))")
        assert nodes.run_on(1, [sys.executable, "-c", reach, nodes.nodes[0].ip]).returncode == 0
        # Losing the head: every process in its namespace dies, and /dev/shm is fresh.
        killed = nodes.kill_node(0)
        assert killed and not [p for p in killed if pid_alive(p)]
        assert nodes.shm_entries(0) == []
    finally:
        nodes.close()
    assert _ours(tag) == {"netns": [], "links": []}
    assert not [p for p in keepers if pid_alive(p)]
    assert not os.path.exists(nodes.rundir)


def test_a_failed_start_removes_what_it_made():
    reason = nc.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    before = _ours("")  # every namespace and link, to compare
    with pytest.raises(netns.IsolatedNodesError, match="ray start on node 0"):
        netns.IsolatedNodes(1, object_store_memory=1, timeout=60)  # Ray refuses 1 byte
    after = _ours("")
    assert after == before
