"""The worker side's averaging over a ring (``_weighted_mean`` and ``_adopt`` of ddlf.training.replica.ring_rounds),
against a fake ring: each rank runs on its own thread, and the fake all-reduce sums their buffers the way the Rust
ring does (the same bits on every rank; float32 rounded to float16 on the wire when asked)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from ddlf.ring_spec import RingSpec
from ddlf.training.replica import ring_rounds
from ddlf.training.replica.ring_rounds import _adopt, _weighted_mean

GROUP = "0123456789abcdef0123456789abcdef"


class FakeRing:
    """Stands in for :func:`ddlf.worker.reduction.reduce_scratch` with ``n`` ranks (``spec.rank``): each call
    blocks until every rank has made it, then every buffer holds the sum, in rank order."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=10)
        self.buffers: dict[int, np.ndarray] = {}
        self.calls: list[tuple[int, np.dtype, str | None]] = []
        self.lock = threading.Lock()
        self.total: np.ndarray | None = None

    def reduce_scratch(self, flat: np.ndarray, spec: RingSpec, op: str = "sum", wire: str | None = None) -> None:
        assert op == "sum" and flat.ndim == 1 and flat.flags.c_contiguous
        rank = spec.rank
        with self.lock:
            self.calls.append((rank, flat.dtype, wire))
            self.buffers[rank] = flat
        self.barrier.wait()
        if rank == 0:
            parts = [self.buffers[r] for r in range(self.n)]
            if wire == "float16":
                with np.errstate(over="ignore"):
                    parts = [p.astype(np.float16).astype(p.dtype) for p in parts]
            total = parts[0].copy()
            for p in parts[1:]:
                total += p
            self.total = total
        self.barrier.wait()
        assert self.total is not None
        flat[...] = self.total
        self.barrier.wait()  # every rank has its copy before the next reduction sets another total

    def spec(self, rank: int) -> RingSpec:
        return RingSpec(GROUP, rank, tuple(f"127.0.0.1:{7000 + r}" for r in range(self.n)))

    def run(self, fn: Any, per_rank: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch, **kw: Any) -> list[Any]:
        """``fn(*per_rank[r], <rank r's RingSpec>, **kw)`` on every rank at once."""
        monkeypatch.setattr(ring_rounds, "reduce_scratch", self.reduce_scratch)
        with ThreadPoolExecutor(self.n) as pool:
            futures = [pool.submit(fn, *args, self.spec(r), **kw) for r, args in enumerate(per_rank)]
            return [f.result(timeout=30) for f in futures]


def _arrays(seed: int) -> list[np.ndarray]:
    r = np.random.default_rng(seed)
    return [
        r.standard_normal((3, 4)).astype(np.float32),
        np.array([seed, 10 * seed], np.int64),  # a step counter: not averaged
        r.standard_normal(5),  # float64
        r.standard_normal(2).astype(np.float32),
    ]


def test_weighted_mean_is_the_samples_weighted_average_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    samples = [32.0, 16.0, 0.0]  # the last rank ran out of rows: it adds nothing, yet gets the average
    inputs = [_arrays(seed) for seed in (1, 2, 3)]
    kept = [[a.copy() for a in arrays] for arrays in inputs]
    ring = FakeRing(3)
    outs = ring.run(_weighted_mean, [(inputs[r], samples[r]) for r in range(3)], monkeypatch)
    for r, (out, total) in enumerate(outs):
        assert total == 48.0
        for j in (0, 2, 3):
            want = sum(s * a[j].astype(np.float64) for s, a in zip(samples, inputs)) / sum(samples)
            assert out[j].dtype == inputs[r][j].dtype and out[j].shape == inputs[r][j].shape
            np.testing.assert_allclose(out[j], want, rtol=1e-6 if out[j].dtype == np.float32 else 1e-12)
        assert out[1] is inputs[r][1]  # integers stay as they are on each rank
        assert all(out[j].tobytes() == outs[0][0][j].tobytes() for j in (0, 2, 3))  # the same bits everywhere
    for arrays, before in zip(inputs, kept):  # the inputs are scaled into a new buffer, not in place
        assert all(a.tobytes() == b.tobytes() for a, b in zip(arrays, before))
    # One reduction per float dtype present, float32 first, on every rank.
    assert sorted(ring.calls, key=lambda c: (c[1] != np.float32, c[0])) == [
        (r, np.dtype(k), None) for k in (np.float32, np.float64) for r in range(3)
    ]


def test_no_samples_on_any_rank_returns_the_arrays_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = [[np.full(3, r + 1.0, np.float32)] for r in range(2)]
    outs = FakeRing(2).run(_weighted_mean, [(inputs[r], 0.0) for r in range(2)], monkeypatch)
    for r, (out, total) in enumerate(outs):
        assert total == 0.0 and out[0] is inputs[r][0] and out[0].tolist() == [r + 1.0] * 3


def test_unit_keeps_weighted_values_within_float16_on_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gradient near float16's limit, weighted by its 16 rows: scaled by 16 it overflows the wire; scaled by
    16 / unit (unit = batch_size = 16) it travels and averages to itself."""
    inputs = [[np.full(4, 30000.0, np.float32)], [np.full(4, 20000.0, np.float32)]]
    rows = [(inputs[0], 16.0), (inputs[1], 16.0)]
    outs = FakeRing(2).run(_weighted_mean, rows, monkeypatch, wire="float16", unit=16.0)
    for out, total in outs:
        assert total == 32.0 and out[0].tolist() == [25000.0] * 4
    outs = FakeRing(2).run(_weighted_mean, rows, monkeypatch, wire="float16")
    assert all(not np.isfinite(out[0]).any() for out, _ in outs)  # unit=1: 16 * 30000 is past 65504


def test_float64_arrays_never_travel_at_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    ring = FakeRing(2)
    precise = 1.0 + 2.0**-40  # not a float16, nor a float32
    args = [([np.full(2, precise), np.ones(2, np.float32)], 1.0) for _ in range(2)]
    outs = ring.run(_weighted_mean, args, monkeypatch, wire="float16")
    assert all(out[0].tolist() == [precise] * 2 for out, _ in outs)
    assert {(dtype, wire) for _, dtype, wire in ring.calls} == {
        (np.dtype(np.float32), "float16"),
        (np.dtype(np.float64), None),
    }


def _optimizer_state(step: int, moment: float) -> list[np.ndarray]:
    return [np.array(step, np.int64), np.full((2, 2), moment, np.float32), np.array([True, False])]


def test_a_new_member_adopts_the_holders_optimizer_state(monkeypatch: pytest.MonkeyPatch) -> None:
    holders = [_optimizer_state(2**40 + 3, 0.25) for _ in range(2)]  # the same on every holder
    new = _optimizer_state(0, 0.0)
    outs = FakeRing(3).run(_adopt, [(holders[0], True), (holders[1], True), (new, False)], monkeypatch)
    for out in outs:
        assert [a.dtype for a in out] == [np.int64, np.float32, np.bool_]
        assert int(out[0]) == 2**40 + 3  # an integer step count, exact through float64
        assert out[1].tolist() == [[0.25, 0.25], [0.25, 0.25]] and out[2].tolist() == [True, False]


def test_with_no_holder_every_member_keeps_its_own_state(monkeypatch: pytest.MonkeyPatch) -> None:
    states = [_optimizer_state(5, 0.5), _optimizer_state(7, 0.75)]
    outs = FakeRing(2).run(_adopt, [(states[0], False), (states[1], False)], monkeypatch)
    assert outs[0] is states[0] and outs[1] is states[1]
