"""Recording gymnasium episodes (every action, observation and reward) into a replay buffer, a
directory of ``.npz`` episode files or counters, and playing recorded directories back.

One module per part: ``format`` (the file format), ``sinks`` (where episodes go), ``wrapper``
(``RecordEpisodes``) and ``playback``. gymnasium is imported only when a recorder is created.
"""

from __future__ import annotations

from .playback import iter_episodes, load_episode, scan_episodes
from .wrapper import RecordEpisodes

__all__ = ["RecordEpisodes", "iter_episodes", "load_episode", "scan_episodes"]
