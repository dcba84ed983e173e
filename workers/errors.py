"""The errors and warnings of the processes around a buffer: sampler workers, actors, pool
options and the Ray cluster, all in one place.

Four of them are defined in ``shmbuf.errors`` and re-exported here: ``WorkerDiedError``,
``WorkerError``, ``ActorError`` and ``DeviceUnavailableError``. ``shmbuf`` exports them
(``shmbuf.WorkerDiedError``, ...) and may not import ``workers``, so they cannot live here
without a second class of the same name; being the same classes, ``except
shmbuf.WorkerDiedError`` and ``except workers.errors.WorkerDiedError`` catch the same error.
The others are ``workers``' own, and every module of ``workers`` imports them from here. Each
error derives from ``shmbuf.ShmbufError`` and from the closest builtin.
"""

from __future__ import annotations

from shmbuf.errors import (
    ActorError,
    DeviceUnavailableError,
    ShmbufError,
    WorkerDiedError,
    WorkerError,
)

__all__ = [
    "ActorError", "DeviceUnavailableError", "HostRestartedWarning", "MainModuleReimportError",
    "NoHostOnNodeError", "NodeLostError", "NodeLostWarning", "OptionError", "WorkerDiedError",
    "WorkerError",
]


class OptionError(ShmbufError, TypeError):
    """An option that the chosen strategy does not take (``SamplerPool(..., alpha=0.1)`` with a
    uniform selection), or one given twice; the message names the object that takes it."""


class MainModuleReimportError(ShmbufError, RuntimeError):
    """Processes were to be started while a child process re-ran the main module as
    ``__mp_main__`` (the spawn and forkserver start methods import the main script in every
    process they start): the script lacks ``if __name__ == "__main__":``."""


# -- the Ray cluster (workers.cluster) ---------------------------------------------------------------
class NoHostOnNodeError(ShmbufError, LookupError):
    """``cluster.writer()`` was called on a Ray node that has no host of this cluster."""


class NodeLostError(ShmbufError, RuntimeError):
    """A node of the cluster is gone (removed, or its host died past its restarts), and the
    sampler was asked to be strict about it."""


class NodeLostWarning(RuntimeWarning):
    """A node was dropped from sampling: its rows are no longer drawn."""


class HostRestartedWarning(RuntimeWarning):
    """A host actor died and Ray restarted it; it re-adopted its node's buffer if it was there."""
