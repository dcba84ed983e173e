"""Saving and restoring replay buffers: checkpoint directories (``save``/``load``) and state
dicts (``state_dict``/``load_state_dict``), as one snapshot (``snapshot``) in two forms
(``directory``, ``state``) checked by one validator (``validate``).
"""

from __future__ import annotations

from .directory import load, save
from .state import load_state_dict, state_dict

__all__ = ["load", "load_state_dict", "save", "state_dict"]
