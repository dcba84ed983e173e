"""The demo shipped with the library (``shmbuf demo``, ``python -m workers.demo``): actors
stepping environments write to a shared buffer while a sampler pool feeds a learner loop.

The modules: ``command`` (the ``shmbuf demo`` command: its arguments and the CLI plugin hook
``register``, named by ``pyproject.toml``'s entry point ``workers.demo:register``),
``actor_learner`` (the demo on this machine), ``ray_nodes`` (the same across local Ray nodes),
``line`` (the live line both print), ``plot`` (``--plot``: throughput over time as a picture),
``envs`` (the synthetic environments it steps).
"""

from __future__ import annotations

from .actor_learner import demo_limits, env_actor, run, train_step
from .command import add_arguments, main, register

__all__ = ["add_arguments", "demo_limits", "env_actor", "main", "register", "run", "train_step"]
