"""ddlf: distributed deep learning on a Rust master/worker runtime.

Start worker daemons (``ddlf-worker --listen HOST:PORT``, or ``Cluster.local(n)`` on this machine), push
persistent variables and functions to them, and call those functions from your script.
"""

from __future__ import annotations

import atexit

from . import _ddlf, callbacks, datasets, errors, ops
from ._ddlf import PROTOCOL_VERSION, __version__
from ._executor import WorkerContext
from .app import IApp
from .cluster import Cluster
from .errors import *  # noqa: F403 - every error class, listed in errors.__all__
from .history import History

__all__ = [
    "PROTOCOL_VERSION",
    "Cluster",
    "History",
    "IApp",
    "WorkerContext",
    "__version__",
    "callbacks",
    "datasets",
    "errors",
    "ops",
]
__all__ += errors.__all__

# This process's pooled shared-memory segments (its sends to workers on this machine, or a worker's replies) are
# removed when it exits; receivers that still map one keep their mapping.
atexit.register(_ddlf.release_shared_memory)
