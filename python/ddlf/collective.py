"""Collectives among workers, from Python: the master's ring plans (:mod:`ddlf.cluster.rings`) and a worker's side of
a reduction (:mod:`ddlf.worker.reduction`). In their own worker functions, users reduce with :func:`reduce_arrays`
and the spec of ``cluster.ring(...)``."""

from __future__ import annotations

from .cluster.rings import RingPlan, Rings, host_of, shares_hosts
from .ring_spec import OPS, WIRES, check_op, check_wire
from .worker.reduction import MAX_RINGS, allreduce_variable, forget, reduce_arrays, reduce_scratch, ring

__all__ = [
    "MAX_RINGS",
    "OPS",
    "WIRES",
    "RingPlan",
    "Rings",
    "allreduce_variable",
    "check_op",
    "check_wire",
    "forget",
    "host_of",
    "reduce_arrays",
    "reduce_scratch",
    "ring",
    "shares_hosts",
]
