"""``workers.cluster``: node-local replay buffers on a Ray cluster, actors writing on their own
node through shared memory, and one sampler for the learner over the union of all nodes' rows.

Needs the ``ray`` extra (``pip install 'shmbuf[ray]'``) and a connected Ray (``ray.init``).
Transitions never leave the node they were written on until a batch is drawn.

The modules: ``replay_cluster`` (``ReplayCluster``), ``nodes`` (node ids, placement, the
picklable ``ClusterClient`` writers use), ``host`` (the host actor: create or re-adopt the
node's buffer), ``sources`` (the local and remote row sources, the host-side ``NodePool``),
``sampler`` and ``batch`` (the learner's ``ClusterSampler`` and batch assembly), ``rate`` (the
per-node rate limit), ``actors`` (supervised Ray actors). Its errors and warnings are in
``workers.errors``.
"""

from __future__ import annotations

from ..errors import (
    HostRestartedWarning,
    MainModuleReimportError,
    NodeLostError,
    NodeLostWarning,
    NoHostOnNodeError,
)
from .actors import ClusterActorContext, ClusterActors
from .nodes import ClusterClient, alive_node_ids, current_node_id, on_node
from .replay_cluster import ReplayCluster
from .sampler import ClusterBatch, ClusterSampler

__all__ = ["ClusterActorContext", "ClusterActors", "ClusterBatch", "ClusterClient",
           "ClusterSampler", "HostRestartedWarning", "MainModuleReimportError",
           "NoHostOnNodeError", "NodeLostError", "NodeLostWarning", "ReplayCluster",
           "alive_node_ids", "current_node_id", "on_node"]
