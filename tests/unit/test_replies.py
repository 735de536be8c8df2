"""The master's checks on workers' training replies (ddlf.training.replies), without daemons."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ddlf.errors import BadWorkerReply, NonFiniteUpdate
from ddlf.training.messages import WorkerResult, finite
from ddlf.training.replies import check_reply, check_states

LIKE = [np.zeros((4, 3), np.float32), np.zeros(3, np.float32)]


def reply(**over: Any) -> dict[str, Any]:
    base = {
        "samples": 64,
        "weights": [np.ones((4, 3), np.float32), np.ones(3, np.float32)],
        "compute_seconds": 0.5,
        "data_wait_seconds": 0.0,
        "logs": {"loss": 0.3},
    }
    return {**base, **over}


def test_a_good_reply_passes_with_its_payload() -> None:
    r = check_reply(3, reply(), LIKE, rows=64, compression=None)
    assert r.worker == 3 and r.samples == 64 and r.logs == {"loss": 0.3}
    assert [a.shape for a in r.payload] == [(4, 3), (3,)]


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"samples": 65}, "samples=65"),
        ({"samples": -1}, "samples=-1"),
        ({"samples": True}, "samples=True"),
        ({"samples": "64"}, "samples='64'"),
        ({"compute_seconds": float("nan")}, "compute_seconds"),
        ({"logs": {"loss": "low"}}, "logs"),
        ({"weights": "abc"}, "weights must be a list"),
        ({"weights": [np.ones((4, 3), np.float32)]}, "1 weight arrays, expected 2"),
        ({"weights": [np.ones((3, 4), np.float32), np.ones(3, np.float32)]}, r"shape \(3, 4\)"),
        ({"weights": [np.ones((4, 3)), np.ones(3)]}, "float64, expected float32"),
        ({"weights": [[1.0] * 12, np.ones(3, np.float32)]}, "is a list, not an array"),
        ({"weights": [np.ones((4, 3), object), np.ones(3, np.float32)]}, "object"),
        ({"optimizer_state": [np.ones(2, object)]}, "object arrays"),
        ({"optimizer_state": "x"}, "optimizer_state"),
    ],
)
def test_malformed_replies_are_refused_naming_the_worker(over: dict[str, Any], match: str) -> None:
    with pytest.raises(BadWorkerReply, match=match) as info:
        check_reply(7, reply(**over), LIKE, rows=64, compression=None)
    assert info.value.worker_id == 7 and "worker 7" in str(info.value)
    assert not isinstance(info.value, NonFiniteUpdate)


def test_a_reply_that_is_not_a_dict() -> None:
    with pytest.raises(BadWorkerReply, match="expected a dict, got list"):
        check_reply(0, [1, 2], LIKE, rows=64, compression=None)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_and_states_are_their_own_error(bad: float) -> None:
    w = [np.ones((4, 3), np.float32), np.ones(3, np.float32)]
    w[1][2] = bad
    with pytest.raises(NonFiniteUpdate, match="worker 2 sent non-finite"):
        check_reply(2, reply(weights=w), LIKE, rows=64, compression=None)
    with pytest.raises(NonFiniteUpdate):
        check_reply(2, reply(optimizer_state=[np.array([1.0, bad])]), LIKE, rows=64, compression=None)


def test_finite_check_has_no_false_alarm_on_huge_float64_values() -> None:
    # The fast path sums in the array's own precision: huge finite values overflow that sum, so they are checked
    # exactly instead (no false alarm); a non-finite element, or +inf with -inf, makes the sum non-finite.
    assert finite(np.full(4, 1e308))
    assert not finite(np.array([1e308, np.nan]))
    assert finite(np.full(1000, np.finfo(np.float32).max, np.float32))
    assert finite(np.full(100, 60000, np.float16))
    assert not finite(np.array([1.0, np.inf, -np.inf], np.float32))
    assert not finite(np.array([-np.inf, 2.0], np.float32))
    assert finite(np.zeros(0, np.float32)) and finite(np.arange(3))


def test_half_precision_deltas() -> None:
    half = [np.ones((4, 3), np.float16), np.ones(3, np.float16)]
    r = check_reply(0, reply(weights=half), LIKE, rows=64, compression="float16")
    assert len(r.payload) == 2 and all(a.dtype == np.float32 for a in r.payload)
    with pytest.raises(BadWorkerReply, match="expected float16 or bfloat16"):
        check_reply(0, reply(), LIKE, rows=64, compression="float16")
    nan_half = [np.full((4, 3), np.nan, np.float16), np.ones(3, np.float16)]
    with pytest.raises(NonFiniteUpdate):
        check_reply(0, reply(weights=nan_half), LIKE, rows=64, compression="float16")


def test_topk_pairs_are_checked_before_they_index_anything() -> None:
    def pairs(idx: list[int], vals: Any = None, dtype: Any = np.int64) -> list[tuple[np.ndarray, np.ndarray]]:
        v = np.ones(len(idx), np.float32) if vals is None else vals
        return [(np.array(idx, dtype), v), (np.array([0], np.int64), np.ones(1, np.float32))]

    r = check_reply(0, reply(weights=pairs([0, 11])), LIKE, rows=64, compression="topk")
    assert len(r.payload) == 2 and r.payload[0].reshape(-1)[11] == 1.0
    for bad, match in [
        (pairs([0, 12]), "outside"),
        (pairs([-1]), "outside"),  # numpy would wrap it to the last element
        (pairs([0, 1], dtype=np.float32), "1-D integers"),
        (pairs([0, 1], vals=np.ones(3, np.float32)), "as many as the values"),
        (pairs([0], vals=np.ones(1, np.float64)), "float32"),
        ([np.ones(3), np.ones(3)], "pair"),
    ]:
        with pytest.raises(BadWorkerReply, match=match):
            check_reply(0, reply(weights=bad), LIKE, rows=64, compression="topk")


def test_all_reduce_replies_carry_no_weights() -> None:
    check_reply(0, reply(weights=[]), LIKE, rows=64, compression=None, weights_expected=False)
    with pytest.raises(BadWorkerReply, match="all-reduce"):
        check_reply(0, reply(), LIKE, rows=64, compression=None, weights_expected=False)


def test_optimizer_states_of_another_structure_are_refused() -> None:
    def result(w: int, shapes: list[tuple[int, ...]] | None) -> WorkerResult:
        state = None if shapes is None else [np.zeros(s, np.float32) for s in shapes]
        return WorkerResult(w, 1, [], 0.0, 0.0, optimizer_state=state)

    good, other, missing = result(0, [(2,), (3,)]), result(1, [(2,)]), result(2, None)
    assert [r.worker for r, _ in check_states([good, other, missing])] == [1, 2]
    assert check_states([good, result(3, [(2,), (3,)])]) == []
    assert check_states([result(0, None)]) == []
