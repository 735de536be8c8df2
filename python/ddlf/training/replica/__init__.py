"""The worker's side of training: one replica of the model per run, trained on the rows the master assigns.

The master calls these endpoints by reference (``cluster.run_each(replica.train_reduce, ...)``); only their
arguments travel. :mod:`.sessions` holds the runs set up on this worker, :mod:`.state` their optimizer and random
state, :mod:`.rounds` and :mod:`.ring_rounds` the two kinds of round, :mod:`.steppers` the frameworks' compiled
steps, :mod:`.buckets` PyTorch's gradient buckets and :mod:`.warm` the models kept warm between runs.
"""

from __future__ import annotations

from .ring_rounds import reduced_weights, train_gradients, train_reduce
from .rounds import train_chunk
from .sessions import configure, runs, setup, teardown
from .state import restore_state, session_state

__all__ = [
    "configure",
    "reduced_weights",
    "restore_state",
    "runs",
    "session_state",
    "setup",
    "teardown",
    "train_chunk",
    "train_gradients",
    "train_reduce",
]
