"""The master: the user's script and its connection to the worker daemons.

:class:`Cluster` is the facade (variables, functions, calls, datasets, rings); behind it, :mod:`.calls` encodes and
sends, :mod:`.recovery` retries and replays what a restarted daemon lost, :mod:`.rings` plans the workers'
all-reduce rings, :mod:`.local` starts daemons on this machine, :mod:`.cluster_file` reads ``cluster.toml`` and
:mod:`.aio` gives every call an awaitable twin.
"""

from __future__ import annotations

from .cluster import Cluster

__all__ = ["Cluster"]
