"""Property tests (hypothesis) of the Rust kernels behind ``ddlf.ops``: for every numpy dtype (float16, bfloat16,
bool, complex, object, structured included), 0-d, empty, non-contiguous, read-only and misaligned arrays, each
function returns the right answer or raises a clear ``TypeError``/``ValueError`` (``IndexError`` for an index out
of range). Never a crash, never a silent wrong answer: a kernel that reads past a buffer fails here even when it
does not crash, because its answer is compared with numpy's."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddlf import ops

CLEAR = (TypeError, ValueError)
DTYPES = [
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.bool_),
    np.dtype(np.int8),
    np.dtype(np.uint8),
    np.dtype(np.int32),
    np.dtype(np.int64),
    np.dtype(np.uint32),
    np.dtype(np.complex64),
    np.dtype(object),
    np.dtype([("a", "<f4"), ("b", "<i4")]),
    np.dtype(">f4"),  # big-endian float32: same itemsize, other byte order
]
LAYOUTS = ["contiguous", "strided", "readonly", "misaligned", "fortran"]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make(dtype: np.dtype, shape: tuple[int, ...], layout: str, seed: int) -> np.ndarray:
    """An array of ``dtype`` and ``shape`` laid out as ``layout``, holding small values."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype.fields is not None:
        base = np.zeros(n, dtype)
        base["a"] = rng.standard_normal(n)
        base["b"] = rng.integers(-5, 5, n)
    elif dtype.kind == "O":
        base = np.array([float(v) for v in rng.standard_normal(n)] + [None], dtype=object)[:n]
    elif dtype.kind == "b":
        base = rng.integers(0, 2, n).astype(dtype)
    else:
        base = (rng.standard_normal(n) * 4).astype(dtype)
    a = base.reshape(shape)
    if layout == "strided" and a.ndim >= 1:
        wide = np.zeros((*shape[:-1], shape[-1] * 2), dtype)
        wide[..., ::2] = a
        a = wide[..., ::2]
    elif layout == "readonly":
        a = a.copy()
        a.flags.writeable = False
    elif layout == "misaligned" and dtype.itemsize > 1 and dtype.kind != "O":
        raw = np.zeros(n * dtype.itemsize + 1, np.uint8)
        a2 = raw[1:].view(dtype).reshape(shape)
        a2[...] = a
        a = a2
    elif layout == "fortran" and a.ndim >= 2:
        a = np.asfortranarray(a)
    return a


shapes = st.one_of(
    st.just(()),
    st.just((0,)),
    st.tuples(st.integers(1, 33)),
    st.tuples(st.integers(1, 9), st.integers(1, 9)),
    st.tuples(st.integers(0, 3), st.integers(1, 5), st.integers(1, 4)),
)
arrays = st.builds(
    make, st.sampled_from(DTYPES), shapes, st.sampled_from(LAYOUTS), st.integers(0, 2**16)
)  # fmt: skip


def _reference_float(a: np.ndarray) -> np.ndarray | None:
    """``a`` as float64 when a float kernel may accept it (a real float dtype, bfloat16 included: half-precision
    weights are averaged in float32), else None."""
    if (a.dtype.kind == "f" and a.dtype.fields is None) or str(a.dtype) == "bfloat16":
        return np.asarray(a, np.float64)
    return None


def _rtol(a: np.ndarray, full: float) -> float:
    """What a result rounded back to ``a``'s dtype can keep: bfloat16 has 8 bits of mantissa, float16 11."""
    return {"bfloat16": 1e-2, "float16": 2e-3}.get(str(a.dtype), full)


@SETTINGS
@given(a=arrays, b_seed=st.integers(0, 2**16), w=st.tuples(st.floats(0.01, 10), st.floats(0.01, 10)))
def test_weighted_average(a: np.ndarray, b_seed: int, w: tuple[float, float]) -> None:
    b = make(a.dtype, a.shape, "contiguous", b_seed)
    try:
        out = ops.weighted_average([[a], [b]], list(w))
    except CLEAR:
        return
    if a.dtype.kind in "iu":  # an integer counter is never averaged: the first list's, unchanged
        assert out[0].dtype == a.dtype and np.array_equal(out[0], a)
        return
    ra, rb = _reference_float(a), _reference_float(b)
    assert ra is not None and rb is not None, f"accepted {a.dtype}"
    want = (w[0] * ra + w[1] * rb) / (w[0] + w[1])
    assert out[0].shape == a.shape
    assert out[0].dtype == a.dtype  # half precision comes back in its own dtype
    np.testing.assert_allclose(np.asarray(out[0], np.float64), want, rtol=_rtol(a, 1e-5), atol=1e-6)


@SETTINGS
@given(a=arrays, alpha=st.floats(-4, 4))
def test_axpy_in_place(a: np.ndarray, alpha: float) -> None:
    before = a.copy()
    d = make(a.dtype, a.shape, "contiguous", 7)
    try:
        ops.axpy_([a], [d], alpha)
    except CLEAR:
        np.testing.assert_array_equal(a, before)  # refused: nothing written
        return
    if a.dtype.kind in "iu":  # an integer counter takes its whole change, whatever alpha
        np.testing.assert_array_equal(a, before + d)
        return
    ra, rd = _reference_float(before), _reference_float(d)
    assert ra is not None and rd is not None and a.flags.writeable, f"accepted {a.dtype} {a.flags}"
    want = ra + alpha * rd
    np.testing.assert_allclose(np.asarray(a, np.float64), want, rtol=_rtol(a, 1e-4), atol=_rtol(a, 1e-5) * 4)


@SETTINGS
@given(a=arrays)
def test_delta(a: np.ndarray) -> None:
    old = make(a.dtype, a.shape, "contiguous", 3)
    try:
        out = ops.delta([a], [old])
    except CLEAR:
        return
    if a.dtype.kind in "iu":  # an integer counter's change, in its dtype
        assert out[0].dtype == a.dtype and np.array_equal(out[0], a - old)
        return
    ra, ro = _reference_float(a), _reference_float(old)
    assert ra is not None and ro is not None, f"accepted {a.dtype}"
    np.testing.assert_allclose(np.asarray(out[0], np.float64).reshape(a.shape), ra - ro, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(a=arrays, half=st.sampled_from(["float16", "bfloat16"]))
def test_half_precision_round_trip(a: np.ndarray, half: str) -> None:
    try:
        out = ops.to_half([a], half)
    except CLEAR:
        return
    assert a.dtype == np.float32, f"to_half accepted {a.dtype}"
    want = np.asarray(a).astype(np.float16 if half == "float16" else ml_dtypes.bfloat16)
    assert str(out[0].dtype) == half
    np.testing.assert_array_equal(np.asarray(out[0]).reshape(-1).view(np.uint16), want.reshape(-1).view(np.uint16))
    back = ops.from_half(out)
    np.testing.assert_array_equal(back[0].reshape(-1), want.astype(np.float32).reshape(-1))


@SETTINGS
@given(a=arrays)
def test_from_half_takes_only_half_arrays(a: np.ndarray) -> None:
    try:
        out = ops.from_half([a])
    except CLEAR:
        return
    assert str(a.dtype) in ("float16", "bfloat16"), f"from_half accepted {a.dtype}"
    np.testing.assert_array_equal(out[0].reshape(-1), np.asarray(a, np.float32).reshape(-1))


@SETTINGS
@given(a=arrays, ratio=st.floats(0.001, 1.0))
def test_topk(a: np.ndarray, ratio: float) -> None:
    try:
        [(idx, vals)] = ops.topk([a], ratio)
    except CLEAR:
        return
    assert a.dtype == np.float32, f"topk accepted {a.dtype}"
    flat = np.ascontiguousarray(a).reshape(-1)
    assert len(idx) == len(vals) <= flat.size
    assert np.all(np.diff(idx.astype(np.int64)) > 0) and (len(idx) == 0 or idx.max() < flat.size)
    np.testing.assert_array_equal(vals, flat[idx])
    if len(idx) and len(idx) < flat.size:  # nothing left out is larger than what was kept
        rest = np.delete(np.abs(flat), idx)
        assert np.abs(vals).min() >= rest.max()


@SETTINGS
@given(a=arrays, idx=st.lists(st.integers(-3, 40), max_size=12), idx_dtype=st.sampled_from(["i8", "u4", "i4", "f8"]))
def test_gather(a: np.ndarray, idx: list[int], idx_dtype: str) -> None:
    indices: Any = np.array(idx).astype(idx_dtype)
    try:
        out = ops.gather(a, indices)
    except (*CLEAR, IndexError):
        return
    if a.ndim == 0:
        pytest.fail("gather accepted a 0-d array")
    want = np.asarray(a)[np.asarray(indices).astype(np.int64)]
    assert all(0 <= i < len(a) for i in np.asarray(indices).astype(np.int64)), "accepted an index out of range"
    assert out.dtype == a.dtype and out.shape == want.shape
    np.testing.assert_array_equal(out, want)
