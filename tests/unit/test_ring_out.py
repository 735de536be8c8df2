"""``Ring.allreduce_(arrays, out=...)``, the out-of-place all-reduce TensorFlow's in-graph exchange uses, on a ring
of one (no daemons): what it writes, what it leaves alone, and what it refuses. Rings of several ranks, flat and
through shared memory, are checked in Rust (``a_list_of_parts_reduces_as_their_concatenation_...``)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from ddlf._ddlf import Ring
from ddlf.ring_spec import RingSpec


def _ring() -> Ring:
    return Ring(RingSpec(group=uuid.uuid4().hex, rank=0, addresses=("127.0.0.1:1",)))


def _sources() -> list[np.ndarray]:
    a = np.arange(7, dtype=np.float32)
    b = np.arange(5, dtype=np.float32).reshape(5, 1) * -1.5
    b.flags.writeable = False  # only read: a read-only source is fine
    return [a, np.zeros(0, np.float32), b]


def test_the_result_lands_in_out_cut_differently_and_the_arrays_are_only_read() -> None:
    ring, src = _ring(), _sources()
    before = [s.copy() for s in src]
    out = [np.full(3, np.nan, np.float32), np.full((3, 3), np.nan, np.float32)]
    ring.allreduce_(src, "mean", atomic=False, out=out)
    want = np.concatenate([s.ravel() for s in before])
    np.testing.assert_array_equal(np.concatenate([o.ravel() for o in out]), want)  # the mean over one rank
    for s, b in zip(src, before):
        np.testing.assert_array_equal(s, b)


@pytest.mark.parametrize(
    ("out", "error", "message"),
    [
        (lambda src: [np.zeros(11, np.float32)], ValueError, "out holds 11 elements and the arrays 12"),
        (lambda src: [np.zeros(12, np.float64)], TypeError, "out\\[0\\] is float64"),
        (lambda src: [np.zeros(12, np.int32)], TypeError, "unsupported dtype"),
        (lambda src: [np.zeros(12, np.float32)[::2].repeat(2)[:11], np.zeros(1, np.float32)], None, None),
        (lambda src: [src[0], np.zeros(5, np.float32)], ValueError, "shares memory"),
        (lambda src: [np.zeros(12, np.float32)[::2], np.zeros(6, np.float32)], ValueError, "C-contiguous"),
    ],
)
def test_bad_outs_are_refused_with_the_reason_and_the_ring_still_reduces(out, error, message) -> None:
    ring, src = _ring(), _sources()
    target = out(src)
    if error is None:
        ring.allreduce_(src, "sum", atomic=False, out=target)  # a fine out, for contrast
    else:
        with pytest.raises(error, match=message):
            ring.allreduce_(src, "sum", atomic=False, out=target)
    fine = [np.empty(12, np.float32)]
    ring.allreduce_(src, "sum", atomic=False, out=fine)
    np.testing.assert_array_equal(fine[0], np.concatenate([s.ravel() for s in src]))


def test_a_read_only_out_is_refused() -> None:
    ring, src = _ring(), _sources()
    ro = np.zeros(12, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out\\[0\\] is read-only"):
        ring.allreduce_(src, "sum", atomic=False, out=[ro])
    assert not ro.any()


def test_without_out_a_read_only_array_is_still_refused() -> None:
    ring, src = _ring(), _sources()
    with pytest.raises(ValueError, match="array 2 is read-only"):
        ring.allreduce_(src, "sum")


def test_sources_may_share_memory_when_only_read() -> None:
    """A framework may hand the same buffer twice (two gradients of one constant): read-only sources may overlap;
    an out array may not overlap them."""
    ring = _ring()
    zero = np.zeros(6, np.float32)
    out = [np.full(4, np.nan, np.float32), np.full(4, np.nan, np.float32)]
    ring.allreduce_([zero[:4], zero[2:6]], "sum", atomic=False, out=out)
    assert not out[0].any() and not out[1].any()


def test_scalar_arrays_go_through_the_workers_reduction_as_flat_views() -> None:
    """A scalar weight's gradient is a 0-d array, which the buffer protocol describes without a shape: the
    worker's out-of-place reduction passes flat views, and the 0-d result is written where it lies."""
    from ddlf.worker.reduction import BucketRing

    ring = BucketRing(RingSpec(group=uuid.uuid4().hex, rank=0, addresses=("127.0.0.1:1",)), "mean")
    assert not ring.shares  # a flat ring of one: no shared memory
    out = [np.full((), np.nan, np.float32), np.full((2, 1), np.nan, np.float32)]
    ring.into([np.array(2.5, np.float32), np.array([[1.0], [-1.0]], np.float32)], out)
    assert float(out[0]) == 2.5 and out[1].ravel().tolist() == [1.0, -1.0]
    with pytest.raises(ValueError, match="C-contiguous"):
        ring.into([np.zeros(4, np.float32)], [np.zeros(8, np.float32)[::2]])


def test_a_result_in_shared_memory_is_refused_where_no_host_holds_every_rank_and_the_ring_still_reduces() -> None:
    from ddlf.errors import CollectiveError

    ring, src = _ring(), _sources()
    assert not ring.shares_results  # a flat ring: no shared memory
    with pytest.raises(TypeError, match="expected float32 or float64"):
        ring.allreduce_shared_([np.zeros(3, np.int32)])
    with pytest.raises(CollectiveError, match="one host holding every rank"):
        ring.allreduce_shared_(src, "mean", tag=1)
    fine = [np.empty(12, np.float32)]
    ring.allreduce_(src, "sum", atomic=False, out=fine)
    np.testing.assert_array_equal(fine[0], np.concatenate([s.ravel() for s in src]))
