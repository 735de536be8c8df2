"""Collectives among workers: ring all-reduce, worker to worker, without the master carrying the data.

The master forms a :class:`RingPlan` (a group id and the workers' addresses in ring order; :class:`Rings` keeps
one per set of workers, ``Cluster.ring`` hands it out) and asks every member to reduce; each worker's part runs
here, on its interpreter thread, and hands the arrays to the Rust ring
(``ddlf._ddlf.Ring``: reduce-scatter then all-gather over direct peer links, the GIL released). A worker keeps
its ring's links between reductions (:data:`MAX_RINGS` rings at most, the oldest closed first), so a training run
pays for connecting once. A ring that fails once is spent; the master retires it (``Cluster.retire_ring``) and the
next request for those workers forms a new one.

Users call :meth:`ddlf.Cluster.allreduce`; training uses the same rings (:class:`~ddlf.Ring`). In their
own worker functions, users reduce with :func:`reduce_arrays` and the spec of ``cluster.ring(...)``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import _ddlf
from ..errors import ConfigError, ConfigTypeError, NotFoundError
from ..ring_spec import RingSpec, check_op, check_wire

MAX_RINGS = 16
"""Rings a worker keeps open at once (each holds two links per stream)."""


_RINGS: OrderedDict[str, _ddlf.Ring] = OrderedDict()


def ring(spec: RingSpec) -> _ddlf.Ring:
    """This worker's ring for ``spec``: the open one, or a new one (closing the oldest past :data:`MAX_RINGS`)."""
    group = spec.group
    r = _RINGS.get(group)
    if r is None:
        r = _ddlf.Ring(spec)
        _RINGS[group] = r
        while len(_RINGS) > MAX_RINGS:
            _RINGS.popitem(last=False)
    else:
        _RINGS.move_to_end(group)
    return r


def forget(group: str) -> None:
    """Close this worker's links of ``group`` (the master retired the ring)."""
    _RINGS.pop(group, None)


@contextlib.contextmanager
def _retired_on_failure(spec: RingSpec) -> Iterator[Any]:
    """This worker's ring for ``spec``; a call on it that fails closes it (a failed ring is spent, or out of step
    with its neighbours: the master retires it)."""
    r = ring(spec)
    try:
        yield r
    except BaseException:
        forget(spec.group)
        raise


def reduce_arrays(arrays: list[np.ndarray], spec: RingSpec, op: str = "mean", wire: str | None = None) -> None:
    """All-reduce ``arrays`` in place with the ring's other members: float32 and float64 arrays (one ring pass
    per dtype, each at its own precision). Arrays that are not C-contiguous and writable are replaced in the list
    by reduced copies. On failure (``ddlf.errors.CollectiveError``) the ring is closed and the arrays are
    unchanged. ``wire="float16"|"bfloat16"``: float32 arrays travel at half precision (half the bytes; sums in
    float32, every member ends with the same bits; float16 overflows past 65504); float64 ones as themselves."""
    check_op(op)
    check_wire(wire)
    for i, a in enumerate(arrays):
        _check_array(i, a)
        if not (a.flags.c_contiguous and a.flags.writeable):
            arrays[i] = np.array(a, order="C", copy=True)
    groups = [[i for i, a in enumerate(arrays) if a.dtype == kind] for kind in (np.float32, np.float64)]
    groups = [g for g in groups if g]
    # Several passes: reduce copies and write them back only once every pass succeeded (all or nothing).
    work = arrays if len(groups) <= 1 else [a.copy() for a in arrays]
    with _retired_on_failure(spec) as r:
        for g in groups or [[]]:
            half = wire if g and work[g[0]].dtype == np.float32 else None
            r.allreduce_(_flat([work[i] for i in g]), op, wire=half)
    if work is not arrays:
        for a, w in zip(arrays, work):
            a[...] = w


def reduce_scratch(flat: np.ndarray, spec: RingSpec, op: str = "sum", wire: str | None = None) -> None:
    """All-reduce one contiguous float32 or float64 buffer where it lies, with no copy; its contents are
    undefined after a failure (for buffers made for the reduction, as training's). ``wire``: as in
    :func:`reduce_arrays` (float32 only)."""
    with _retired_on_failure(spec) as r:
        r.allreduce_([flat], check_op(op), atomic=False, wire=check_wire(wire))


class BucketRing:
    """The reductions a round's gradient buckets make on ring ``spec``: ``op`` over the ranks, ``wire`` as in
    :func:`reduce_arrays`. Called with a flat buffer, it reduces it in place (:func:`reduce_scratch`: PyTorch's
    buckets); :meth:`into` and :meth:`shared` reduce out of place (TensorFlow's graph). ``shares``: whether
    :meth:`shared` works here (one host holds every rank, full precision on the wire)."""

    def __init__(self, spec: RingSpec, op: str, wire: str | None = None) -> None:
        self.spec, self.op, self.wire = spec, check_op(op), check_wire(wire)
        self.shares = wire is None and bool(ring(spec).shares_results)

    def __call__(self, flat: np.ndarray) -> None:
        """:func:`reduce_scratch` with the op and wire checked once, in ``__init__``."""
        with _retired_on_failure(self.spec) as r:
            r.allreduce_([flat], self.op, atomic=False, wire=self.wire)

    def into(self, parts: list[np.ndarray], out: list[np.ndarray]) -> None:
        """The concatenation of ``parts`` (only read) reduced into ``out``'s arrays (as many elements, contiguous,
        float32 or float64 like the parts), with no copy on one host's shared memory; ``out`` is undefined after
        a failure."""
        if not all(o.flags.c_contiguous for o in out):
            raise ConfigError("BucketRing.into: the out arrays must be C-contiguous (their flat views are written)")
        with _retired_on_failure(self.spec) as r:
            r.allreduce_(_flat(parts), self.op, atomic=False, wire=self.wire, out=_flat(out))

    def shared(self, parts: list[np.ndarray], tag: int) -> np.ndarray:
        """The concatenation of ``parts`` (only read) reduced and returned where the host's shared memory holds
        it, as a flat, read-only array (cache-line aligned, no copy out). Rewritten by the next call with the
        same ``tag`` (1 or more, the same on every rank): read it before that call. Only where :attr:`shares`."""
        dtype = parts[0].dtype if parts else np.dtype(np.float32)
        with _retired_on_failure(self.spec) as r:
            shared = r.allreduce_shared_(_flat(parts), self.op, tag=tag)
        return np.frombuffer(memoryview(shared), dtype=dtype)


def _flat(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Flat views (copies only of parts that are not contiguous, which are only read): a 0-d array (a scalar
    weight's gradient) has no shape for the buffer protocol to describe."""
    return [np.reshape(a, -1) for a in arrays]


def _variable_arrays(worker: Any, name: str) -> tuple[Any, list[Any]]:
    """The variable ``name`` and its arrays (itself, or the items of a list or tuple)."""
    if name not in worker.vars:
        raise NotFoundError(f"no variable named {name!r} on this worker")
    value = worker.vars[name]
    if isinstance(value, np.ndarray):
        return value, [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigTypeError(
            f"allreduce: variable {name!r} holds {type(value).__name__}; expected a numpy array or a list of them"
        )
    return value, list(value)


def describe_variable(worker: Any, name: str) -> list[tuple[str, tuple[int, ...]]]:
    """Run on every worker by :meth:`ddlf.Cluster.allreduce` before any of them joins the ring: the dtype and shape
    of each array of variable ``name``, after the checks the reduction makes (raising as it would), so that a
    variable that is missing, of the wrong kind or unlike the others' fails the call at once on every worker
    instead of leaving the others waiting in the ring."""
    _, arrays = _variable_arrays(worker, name)
    for i, a in enumerate(arrays):
        _check_array(i, a)
    return [(a.dtype.name, tuple(a.shape)) for a in arrays]


def _check_array(i: int, a: Any) -> None:
    if not isinstance(a, np.ndarray):
        raise ConfigTypeError(f"allreduce: item {i} is {type(a).__name__}, not a numpy array")
    if a.dtype not in (np.float32, np.float64):
        raise ConfigTypeError(f"allreduce: array {i} is {a.dtype}; only float32 and float64 arrays are reduced")


def allreduce_variable(worker: Any, name: str, spec: RingSpec, op: str, wire: str | None = None) -> None:
    """Run on a worker by :meth:`ddlf.Cluster.allreduce`: reduce the variable ``name`` (an array, or a list or
    tuple of arrays) in place with the ring's other members."""
    value, arrays = _variable_arrays(worker, name)
    single = isinstance(value, np.ndarray)
    reduce_arrays(arrays, spec, op, wire)
    worker.vars[name] = arrays[0] if single else (tuple(arrays) if isinstance(value, tuple) else arrays)
