"""ddlf: distributed deep learning on a Rust master/worker runtime.

Start worker daemons (``ddlf-worker --listen HOST:PORT``, or ``Cluster.local(n)`` on this machine), push
persistent variables and functions to them, and call those functions from your script.
"""

from __future__ import annotations

from . import callbacks, datasets, errors, ops, spark
from ._ddlf import PROTOCOL_VERSION, __version__
from .cluster import Cluster
from .errors import *  # noqa: F403 - every error class and warning, listed in errors.__all__
from .training.app import IApp
from .training.history import History
from .training.options import (
    Asynchronous,
    AutoExchange,
    DataConfig,
    DynSGD,
    GradientAveraging,
    ModelAveraging,
    Nesterov,
    Ring,
    RunConfig,
    ThroughMaster,
    TopK,
    TrainConfig,
)
from .training.policy import FailurePolicy
from .tune import SweepResult, Trial, sweep
from .worker.executor import WorkerContext

__all__ = [
    "PROTOCOL_VERSION",
    "Asynchronous",
    "AutoExchange",
    "Cluster",
    "DataConfig",
    "DynSGD",
    "FailurePolicy",
    "GradientAveraging",
    "History",
    "IApp",
    "ModelAveraging",
    "Nesterov",
    "Ring",
    "RunConfig",
    "SweepResult",
    "ThroughMaster",
    "TopK",
    "TrainConfig",
    "Trial",
    "WorkerContext",
    "__version__",
    "callbacks",
    "datasets",
    "errors",
    "ops",
    "spark",
    "sweep",
]
__all__ += errors.__all__
