"""A worker back to the state it started in, without a restart (``Cluster.reset``, ``ddlf reset``).

:func:`reset` runs on the worker's interpreter thread, between requests: it refuses while a training run is held
(another master's, or one left behind) unless forced, then tears down every run and drops the warm models (the
registered services, :mod:`.services`), drops every cached dataset (the host's shared copy goes when no other worker
maps it), forgets every uploaded module, clears Keras' session (and JAX's compiled functions), reseeds the random
generators from fresh entropy, drops the variables, functions and ``exec`` namespace and what TensorFlow keeps of traced
graphs (:mod:`ddlf.frameworks.tensorflow_graphs`), and collects the garbage once (Keras' own collection is skipped),
then freezes what survives, as the daemon's preload did (:func:`ddlf.process.freeze_heap`): the next reset, and the
collections of the next run, walk only what came after. Last, the memory the allocator keeps free goes back to the
system (:func:`ddlf.process.return_free_memory`). ``clean()`` drops only the variables, functions and namespace; a
reset is for a daemon that serves many scripts for days.
"""

from __future__ import annotations

import gc
import logging
import random
import sys
from typing import Any

from ..errors import ResetRefused
from ..frameworks.keras_backend import clear_sessions
from ..frameworks.tensorflow_graphs import forget_custom_gradients
from ..process import freeze_heap, return_free_memory
from . import services

log = logging.getLogger("ddlf.worker")


def held() -> list[str]:
    """What this worker holds that a reset would end (its training runs), described."""
    return services.busy()


def reset(worker: Any, force: bool = False) -> dict[str, Any]:
    """Reset this worker (see the module docs); returns what was dropped. ``worker``: the call's context."""
    held = services.busy()
    if held and not force:
        raise ResetRefused(
            f"this worker serves training runs: {', '.join(held)}; reset(force=True) tears them down (their "
            "masters then lose this worker)"
        )
    dropped: dict[str, Any] = services.reset_all(worker)
    from ..data import node_store
    from ..data.store import STORE

    datasets = STORE.keys()
    for key in datasets:
        STORE.drop(key)
    node_store.sweep()  # the host's copies no other worker maps
    dropped["datasets"] = datasets
    executor = worker._executor
    dropped["modules"] = executor.forget_modules()
    clear_sessions()  # Keras' and JAX's: the one full collection is below
    dropped["custom_gradients"] = forget_custom_gradients()  # what clear_session leaves of the traced graphs
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    dropped.update(executor._clean("", "", None))
    dropped["collected"] = gc.collect()
    freeze_heap()  # the state this worker starts the next script in: out of the collector's full scans
    return_free_memory()  # and what the allocator kept free goes back to the system
    log.info("worker reset: %s", {k: v for k, v in dropped.items() if v})
    return dropped
