"""Ray nodes on one machine that share nothing a second machine would not share: each node runs
in its own network namespace (a veth pair on a bridge made for the purpose, one private address,
no default route), mount namespace (its own /dev/shm and Ray's /tmp/ray, both fresh tmpfs; the rest of /tmp
is the machine's, so a checkout or venv under /tmp stays visible) and host name.
For tests, the demo and the benchmarks of ``workers.cluster`` (``IsolatedNodes``); needs root.

What a node is here: a *keeper* process (``sleep``) holds the node's namespaces; ``ray start``
and every process of the node run in them (``nsenter -t <keeper>``). The learner runs in the
head node's namespaces too (``learner_command``): Python has no ``os.setns`` before 3.12, so it
is a process of its own. Losing a node kills every process in its network namespace but the
keeper; ``start_node`` brings it back as a new Ray node (new id, empty /dev/shm and /tmp/ray).

Traffic: the namespaces reach only each other's addresses on the bridge (which has no address
of its own) and their own loopback; nothing routes elsewhere, ``/etc/resolv.conf`` is empty
(a name lookup asks the node's own loopback) and Ray's usage stats are off.

    python -m workers.cluster.netns check       # can this machine run isolated nodes? (why not)
    python -m workers.cluster.netns cleanup     # remove what a killed run left behind
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

ENV = "SHMBUF_RAY_ISOLATED"  # the description a process inside the head node connects by
PREFIX = "shmbuf"  # namespaces: shmbuf-<tag>-n<k>; links: sb<tag><k>... (15 characters at most)
SUBNET = "10.213.0"  # each cluster has a bridge of its own: the same subnet never meets another
RAY_PORT = 6379
TOOLS = ("ip", "nsenter", "unshare", "mount")
# Every node and learner: no usage stats; no token auth (a token in ~/.ray would turn it on for
# the head only, and the bridge reaches nothing but the nodes).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


class IsolatedNodesError(RuntimeError):
    """An isolated node could not be made, started or stopped (the message says which step)."""


@dataclass
class Node:
    """One isolated node: its namespace, address, keeper process and current Ray node id."""

    index: int
    netns: str
    ip: str
    hostname: str
    keeper: int  # pid of the process that holds the node's namespaces
    node_id: str = ""  # the Ray node id while Ray runs there ("" before and after)
    starts: int = 0  # how many times Ray was started here


def unavailable_reason() -> str | None:
    """Why isolated nodes cannot run here (None: they can): root, the tools, namespaces."""
    if sys.platform != "linux":
        return f"isolated Ray nodes need Linux namespaces, not {sys.platform}"
    if os.geteuid() != 0:
        return "isolated Ray nodes need root (network and mount namespaces, a bridge)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"isolated Ray nodes need {', '.join(missing)} (iproute2, util-linux)"
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "true"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot make namespaces here: {probe.stderr.strip() or probe.returncode}"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _run(cmd: Sequence[str], what: str, timeout: float = 60.0, check: bool = True,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise IsolatedNodesError(f"{what}: `{' '.join(cmd)}` took over {timeout}s") from e
    if check and out.returncode != 0:
        raise IsolatedNodesError(f"{what}: `{' '.join(cmd)}` exited {out.returncode}: "
                                 f"{(out.stderr or out.stdout).strip()[-2000:]}")
    return out


def _netns_inode(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def pids_in_netns(keeper: int) -> list[int]:
    """Every process in the network namespace of ``keeper`` (keeper included)."""
    ns = _netns_inode(keeper)
    if ns is None:
        return []
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _netns_inode(int(entry)) == ns:
            out.append(int(entry))
    return out


def _kill_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_gone(keeper: int, keep: set[int], timeout: float) -> list[int]:
    """Wait until no process but ``keep`` runs in ``keeper``'s namespace; those still alive.
    Reaps the ones that are this process's children (a subreaper inherits ``ray start``'s)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids_in_netns(keeper) if p not in keep]
        for pid in left:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        left = [p for p in left if _alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rindex(b")") + 2:data.rindex(b")") + 3] not in (b"Z", b"X")


class IsolatedNodes:
    """``n_nodes`` Ray nodes on this machine, each in namespaces of its own (see the module).

    Args:
        n_nodes: Ray nodes started (node 0 is the head, where the learner runs).
        spare: further namespaces made ready without Ray (``start_node`` starts one later:
            a node added to a running cluster).
        shm_size: each node's /dev/shm tmpfs (``mount -o size=``; Ray's object store lives
            there too).
        num_cpus, object_store_memory: each Ray node's.
        env: extra environment for the Ray nodes (e.g. ``PYTHONPATH``).
        timeout: seconds for each step (a node's ``ray start``, the cluster seeing it).

    Concurrency: one owner (the process that made it) creates and removes the namespaces,
    links and bridge; ``kill_node`` / ``start_node`` may also be called from a process inside
    the head node that ``attach``ed the description (they only use the keepers' pids).

    Example:
        >>> with IsolatedNodes(3) as nodes:
        ...     subprocess.run(nodes.learner_command([sys.executable, "learner.py"]),
        ...                    env=nodes.learner_env(), check=True)
    """

    def __init__(self, n_nodes: int, *, spare: int = 0, shm_size: str = "1g",
                 tmp_size: str = "1g", num_cpus: int = 1,
                 object_store_memory: int = 128 << 20, env: dict[str, str] | None = None,
                 timeout: float = 120.0, _attached: dict[str, Any] | None = None) -> None:
        if _attached is not None:
            self._load(_attached)
            self.owner = False
            return
        if not isinstance(n_nodes, int) or not 1 <= n_nodes <= 200:
            raise ValueError(f"n_nodes must be an int in [1, 200], got {n_nodes!r}")
        if not isinstance(spare, int) or spare < 0 or n_nodes + spare > 200:
            raise ValueError(f"spare must be an int >= 0 (n_nodes + spare <= 200), got {spare!r}")
        reason = unavailable_reason()
        if reason is not None:
            raise IsolatedNodesError(reason)
        self.owner = True
        self.tag = f"{os.getpid() % 100000:05d}{secrets.token_hex(1)}"  # 7: link names fit
        self.shm_size, self.tmp_size = shm_size, tmp_size
        self.num_cpus, self.object_store_memory = num_cpus, object_store_memory
        self.env = dict(env or {})
        self.timeout = timeout
        self.bridge = f"sb{self.tag}br"
        self.rundir = tempfile.mkdtemp(prefix=f"{PREFIX}-netns-{self.tag}-")
        self.nodes: list[Node] = []
        self._links: list[str] = []
        self._netns: list[str] = []
        self._closed = False
        try:
            self._make_bridge()
            for k in range(n_nodes + spare):
                self.nodes.append(self._make_node(k, n_nodes + spare))
            for k in range(n_nodes):
                self.start_node(k)
        except BaseException:
            self.close()
            raise

    # -- description (for a process inside the head node) -----------------------------------------
    def describe(self) -> dict[str, Any]:
        return {"tag": self.tag, "head": self.head_address, "shm_size": self.shm_size,
                "tmp_size": self.tmp_size, "num_cpus": self.num_cpus,
                "object_store_memory": self.object_store_memory, "env": self.env,
                "timeout": self.timeout, "nodes": [asdict(n) for n in self.nodes]}

    def _load(self, d: dict[str, Any]) -> None:
        self.tag = d["tag"]
        self.shm_size, self.tmp_size = d["shm_size"], d["tmp_size"]
        self.num_cpus, self.object_store_memory = d["num_cpus"], d["object_store_memory"]
        self.env, self.timeout = dict(d["env"]), float(d["timeout"])
        self.nodes = [Node(**n) for n in d["nodes"]]
        self._closed = False

    @classmethod
    def attach(cls, description: dict[str, Any] | None = None) -> IsolatedNodes:
        """The nodes a process inside the head node was started in (``learner_env``)."""
        if description is None:
            raw = os.environ.get(ENV)
            if not raw:
                raise IsolatedNodesError(f"${ENV} is not set: this process was not started by "
                                         f"IsolatedNodes.learner_command")
            description = json.loads(raw)
        return cls(0, _attached=description)

    @property
    def head_address(self) -> str:
        return f"{self.nodes[0].ip}:{RAY_PORT}"

    # -- the learner ----------------------------------------------------------------------------------
    def learner_command(self, argv: Sequence[str], node: int = 0,
                        cwd: str | None = None) -> list[str]:
        """``argv`` run inside node ``node``'s namespaces (network, mount, host name), in
        ``cwd`` (default this process's working directory: the filesystem is shared)."""
        return ["nsenter", "-t", str(self.nodes[node].keeper), "-n", "-m", "-u",
                f"--wd={cwd or os.getcwd()}", "--", *argv]

    def learner_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment for ``learner_command``: ``base`` (default ours) with the cluster's
        description (``attach``, ``connect``) and Ray's usage stats off."""
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not k.startswith("RAY_")}
        env.update(self.env)
        env.update({ENV: json.dumps(self.describe()), **RAY_ENV})
        return env

    def shm_entries(self, node: int) -> list[str]:
        """The names in node ``node``'s own /dev/shm."""
        out = _run(["nsenter", "-t", str(self.nodes[node].keeper), "-m", "--",
                    "ls", "-A", "/dev/shm"], f"list node {node}'s /dev/shm")
        return sorted(out.stdout.split())

    def run_on(self, node: int, argv: Sequence[str], timeout: float = 120.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside node ``node`` (its namespaces) and return what it printed."""
        return _run(self.learner_command(argv, node), f"run on node {node}", timeout,
                    check=False, env=self.learner_env(env))

    # -- making the namespaces ----------------------------------------------------------------------
    def _make_bridge(self) -> None:
        _run(["ip", "link", "add", "name", self.bridge, "type", "bridge"], "make the bridge")
        self._links.append(self.bridge)
        # Bridged frames skip the host's iptables (br_netfilter) where the kernel allows.
        _run(["ip", "link", "set", "dev", self.bridge, "type", "bridge", "nf_call_iptables", "0"],
             "bridge option", check=False)
        _run(["ip", "link", "set", self.bridge, "up"], "bring the bridge up")

    def _make_node(self, k: int, total: int) -> Node:
        netns = f"{PREFIX}-{self.tag}-n{k}"
        ip = f"{SUBNET}.{k + 1}"
        host_end, node_end = f"sb{self.tag}{k}h", f"sb{self.tag}{k}n"
        _run(["ip", "netns", "add", netns], f"make namespace {netns}")
        self._netns.append(netns)
        _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end],
             "make a veth pair")
        self._links.append(host_end)
        _run(["ip", "link", "set", node_end, "netns", netns], "move the veth end")
        _run(["ip", "link", "set", host_end, "master", self.bridge, "up"], "attach the veth")
        inside = ["ip", "netns", "exec", netns]
        _run([*inside, "ip", "link", "set", "lo", "up"], "loopback up")
        _run([*inside, "ip", "addr", "add", f"{ip}/24", "dev", node_end], "node address")
        _run([*inside, "ip", "link", "set", node_end, "up"], "node link up")
        hostname = f"{PREFIX}-{self.tag}-n{k}"
        hosts = os.path.join(self.rundir, f"hosts{k}")
        with open(hosts, "w") as f:
            f.write(f"127.0.0.1 localhost\n{ip} {hostname}\n")
            for j in range(total):
                if j != k:
                    f.write(f"{SUBNET}.{j + 1} {PREFIX}-{self.tag}-n{j}\n")
        resolv = os.path.join(self.rundir, "resolv.conf")
        open(resolv, "w").close()  # no name server: a lookup asks the node's own loopback
        script = (f"hostname {hostname} && mount --bind {hosts} /etc/hosts && "
                  f"mount --bind {resolv} /etc/resolv.conf && "
                  f"{_fresh_mounts(self.shm_size, self.tmp_size)} && "
                  f"echo ready && exec sleep 1000000000")
        keeper = subprocess.Popen(
            [*inside, "unshare", "--mount", "--uts", "--propagation", "private",
             "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        assert keeper.stdout is not None
        line = keeper.stdout.readline()  # "ready" once the mounts are in place
        if line.strip() != "ready":
            keeper.kill()
            err = keeper.stderr.read() if keeper.stderr else ""
            raise IsolatedNodesError(f"node {k}'s keeper failed: {err.strip()}")
        # The keeper is `sleep` now (exec): its pid is the one Popen knows.
        return Node(k, netns, ip, hostname, keeper.pid)

    # -- Ray on a node ------------------------------------------------------------------------------
    def _ray_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")
               and k != ENV}
        env.update(self.env)
        env.update(RAY_ENV)
        return env

    def start_node(self, k: int) -> str:
        """Start Ray in node ``k`` (the head for node 0, else joining it); its new node id.
        A node that ran before comes back as a new Ray node."""
        node = self.nodes[k]
        if node.node_id:
            raise IsolatedNodesError(f"node {k} runs Ray already ({node.node_id[:12]}): "
                                     f"kill_node({k}) first")
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        args = [ray, "start", f"--node-ip-address={node.ip}", f"--num-cpus={self.num_cpus}",
                f"--object-store-memory={self.object_store_memory}", "--disable-usage-stats"]
        args += (["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if k == 0
                 else [f"--address={self.head_address}"])
        _run(self.learner_command(args, k), f"ray start on node {k}", self.timeout,
             env=self._ray_env())
        node.starts += 1
        node.node_id = self._wait_node_id(k)
        return node.node_id

    def _wait_node_id(self, k: int) -> str:
        """The id of the live Ray node at node ``k``'s address (asked from inside node k)."""
        code = ("import json, ray; ray.init(address='auto', logging_level='ERROR', "
                f"log_to_driver=False, _node_ip_address={self.nodes[k].ip!r}); print(json.dumps([(n['NodeManagerAddress'], n['NodeID'])"
                " for n in ray.nodes() if n['Alive']]))")
        deadline = time.monotonic() + self.timeout
        while True:
            out = _run(self.learner_command([sys.executable, "-c", code], k),
                       f"node {k}'s Ray id", self.timeout, check=False, env=self._ray_env())
            if out.returncode == 0:
                ids = [i for ip, i in json.loads(out.stdout.strip().splitlines()[-1])
                       if ip == self.nodes[k].ip]
                if ids:
                    return ids[0]
            if time.monotonic() >= deadline:
                raise IsolatedNodesError(f"node {k} did not join the Ray cluster in "
                                         f"{self.timeout}s: {out.stderr.strip()[-1500:]}")
            time.sleep(0.5)

    def kill_node(self, k: int, timeout: float = 30.0) -> list[int]:
        """Lose node ``k``: SIGKILL every process in its network namespace but the keeper, then
        give it a fresh /dev/shm and /tmp/ray (a machine that went down). The pids killed."""
        node = self.nodes[k]
        keep = {node.keeper}
        pids = [p for p in pids_in_netns(node.keeper) if p not in keep]
        _kill_all(pids, signal.SIGKILL)
        left = _wait_gone(node.keeper, keep, timeout)
        if left:
            raise IsolatedNodesError(f"processes of node {k} still alive after SIGKILL: {left}")
        _run(["nsenter", "-t", str(node.keeper), "-m", "--", "sh", "-c",
              f"umount -l /dev/shm && umount -l /tmp/ray && "
              f"{_fresh_mounts(self.shm_size, self.tmp_size)}"], f"reset node {k}'s tmpfs")
        node.node_id = ""
        return pids

    # -- teardown -------------------------------------------------------------------------------------
    def close(self, timeout: float = 30.0) -> None:
        """Stop every process of every node (keepers included) and remove the namespaces, links
        and bridge this object made. Idempotent; only the owner removes anything."""
        if self._closed or not getattr(self, "owner", False):
            self._closed = True
            return
        self._closed = True
        errors = []
        for node in self.nodes:  # Ray first (SIGTERM: ray's own exit), then everything
            _kill_all([p for p in pids_in_netns(node.keeper) if p != node.keeper],
                      signal.SIGTERM)
        deadline = time.monotonic() + min(timeout, 5.0)
        while time.monotonic() < deadline and any(
                p != n.keeper and _alive(p) for n in self.nodes for p in pids_in_netns(n.keeper)):
            time.sleep(0.1)
        for node in self.nodes:
            _kill_all(pids_in_netns(node.keeper), signal.SIGKILL)
            left = _wait_gone(node.keeper, set(), timeout)
            if left:
                errors.append(f"node {node.index}: pids {left} survived SIGKILL")
        for netns in self._netns:
            _kill_by_netns(netns)
            out = _run(["ip", "netns", "del", netns], "remove namespace", check=False)
            if out.returncode != 0 and "No such file" not in out.stderr:
                errors.append(out.stderr.strip())
        for link in reversed(self._links):
            _run(["ip", "link", "del", link], "remove link", check=False)  # gone with its peer
        shutil.rmtree(getattr(self, "rundir", ""), ignore_errors=True)
        if errors:
            raise IsolatedNodesError("; ".join(errors))

    def __enter__(self) -> IsolatedNodes:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<IsolatedNodes {self.tag} {[(n.ip, n.node_id[:8]) for n in self.nodes]}>"


def _fresh_mounts(shm_size: str, tmp_size: str) -> str:
    return (f"mount -t tmpfs -o size={shm_size},mode=1777 shmbuf-node-shm /dev/shm && "
            f"mkdir -p /tmp/ray && "
            f"mount -t tmpfs -o size={tmp_size},mode=1777 shmbuf-node-tmp /tmp/ray")


def _kill_by_netns(netns: str) -> None:
    """SIGKILL what still runs in the named namespace (``ip netns pids``)."""
    out = _run(["ip", "netns", "pids", netns], "list a namespace's pids", check=False)
    _kill_all([int(p) for p in out.stdout.split() if p.isdigit()], signal.SIGKILL)


def connect(**init_kwargs: Any) -> dict[str, Any]:
    """``ray.init`` to the isolated cluster this process was started in (``ENV``), on the head
    node's address; returns the description."""
    import ray

    desc = json.loads(os.environ[ENV])
    head = desc["nodes"][0]
    init_kwargs.setdefault("log_to_driver", False)
    ray.init(address=desc["head"], _node_ip_address=head["ip"], **init_kwargs)
    return desc


def inside() -> bool:
    """True in a process that ``IsolatedNodes.learner_command`` started."""
    return bool(os.environ.get(ENV))


def cleanup_stale() -> list[str]:
    """Remove the namespaces, links and processes of runs whose owner died (names carry the
    owner's pid). The names removed."""
    out = _run(["ip", "netns", "list"], "list namespaces", check=False)
    removed = []
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != PREFIX or len(parts[1]) != 7:
            continue
        owner = int(parts[1][:5])
        if _alive(owner) and _cmdline_is_python(owner):
            continue  # (pids wrap at 100000 here: a live python of that pid may own it)
        _kill_by_netns(name)
        _run(["ip", "netns", "del", name], "remove namespace", check=False)
        removed.append(name)
        for rundir in glob.glob(os.path.join(tempfile.gettempdir(),
                                             f"{PREFIX}-netns-{parts[1]}-*")):
            shutil.rmtree(rundir, ignore_errors=True)
    links = _run(["ip", "-o", "link", "show", "type", "bridge"], "list bridges", check=False)
    for line in links.stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith("sb") and name.endswith("br") and len(name) == 11:
            if not any(r.split("-")[1] == name[2:9] for r in _live_netns()):
                _run(["ip", "link", "del", name], "remove bridge", check=False)
                removed.append(name)
    return removed


def _live_netns() -> list[str]:
    out = _run(["ip", "netns", "list"], "list namespaces", check=False)
    return [ln.split()[0] for ln in out.stdout.splitlines()
            if ln.split() and ln.split()[0].startswith(f"{PREFIX}-")
            and len(ln.split()[0].split("-")) == 3]


def _cmdline_is_python(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"python" in f.read()
    except OSError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["check"]:
        reason = unavailable_reason()
        print(reason or "isolated Ray nodes can run here")
        return 0 if reason is None else 1
    if args == ["cleanup"]:
        print("\n".join(cleanup_stale()) or "nothing to remove")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
