"""Which rows each worker trains: the plans, without daemons."""

from __future__ import annotations

import numpy as np
import pytest

import ddlf
from ddlf.errors import ConfigError
from ddlf.training.options import TrainConfig
from ddlf.training.plan import SHARD_SEED_STRIDE, ShardPlan, SlicePlan, chunks, shard_layout, whole_batch_sizes


def _all_rows(plan: SlicePlan, live: list[int]) -> list[np.ndarray]:
    out = []
    while not plan.finished():
        for _w, part in plan.next_round(live):
            out.append(np.asarray(part.indices))
    return out


@pytest.mark.parametrize("avg", [None, 1, 7])
def test_a_slice_plan_trains_every_row_once_per_epoch(avg: int | None) -> None:
    cfg = TrainConfig(epochs=1, batch_size=8, strategy=ddlf.ModelAveraging(every=avg), run=ddlf.RunConfig(seed=3))
    rows = np.concatenate(_all_rows(SlicePlan(1001, 3, cfg, epoch=0), [0, 1, 2]))
    assert sorted(rows.tolist()) == list(range(1001))
    again = np.concatenate(_all_rows(SlicePlan(1001, 3, cfg, epoch=0), [0, 1, 2]))
    assert (rows == again).all()  # seeded: the same epoch plans the same rows
    other = np.concatenate(_all_rows(SlicePlan(1001, 3, cfg, epoch=1), [0, 1, 2]))
    assert not (rows == other).all()


def test_a_lost_worker_share_goes_to_the_live_ones() -> None:
    cfg = TrainConfig(epochs=1, batch_size=10, strategy=ddlf.ModelAveraging(every=1))
    plan = SlicePlan(100, 3, cfg, epoch=0)
    first = plan.next_round([0, 1, 2])
    assert [len(p.indices) for _, p in first] == [10, 10, 10]
    second = plan.next_round([0, 2])  # worker 1 lost
    assert [w for w, _ in second] == [0, 2]
    seen = [r for _, p in first + second for r in p.indices.tolist()]
    seen += [r for rows in _all_rows(plan, [0, 2]) for r in rows.tolist()]
    assert sorted(seen) == list(range(100))


def test_worker_shares_split_rows_unevenly() -> None:
    cfg = TrainConfig(epochs=1, batch_size=10, data=ddlf.DataConfig(worker_shares=(3.0, 1.0)))
    [(w0, a), (w1, b)] = SlicePlan(400, 2, cfg, epoch=0).next_round([0, 1])
    assert (w0, w1) == (0, 1) and len(a.indices) == 300 and len(b.indices) == 100


def test_seeded_plans_send_bounds_not_indices() -> None:
    cfg = TrainConfig(epochs=1, batch_size=10, data=ddlf.DataConfig(send="seed"), run=ddlf.RunConfig(seed=5))
    [(_, a), (_, b)] = SlicePlan(50, 2, cfg, epoch=2).next_round([0, 1])
    assert a.indices is None and a.seeded == (5, 2, [1.0], 0, 0, 25) and b.seeded[4:] == (25, 50)


@pytest.mark.parametrize(
    ("total", "shares", "batch", "sizes"),
    [
        (12000, [1.0, 1.0], 32, [6016, 5984]),  # an even split, 6,000 each, would end both in a batch of 16
        (12010, [1.0, 1.0], 32, [6016, 5994]),  # the one partial batch (10 rows) to the worker with fewer rows
        (1001, [1.0, 1.0, 1.0], 8, [336, 336, 329]),
        (400, [3.0, 1.0], 10, [300, 100]),  # shares, in whole batches
        (40, [1.0, 1.0], 32, [32, 8]),  # fewer rows than a batch per worker: one whole batch and the rest
        (5, [1.0, 1.0, 1.0], 8, [5, 0, 0]),
        (0, [1.0, 1.0], 8, [0, 0]),
    ],
)
def test_a_round_is_split_in_whole_batches_with_at_most_one_partial(
    total: int, shares: list[float], batch: int, sizes: list[int]
) -> None:
    got = whole_batch_sizes(total, shares, batch)
    assert got == sizes and sum(got) == total
    assert sum(1 for n in got if n % batch) <= 1


def test_whole_batches_need_a_batch_size() -> None:
    with pytest.raises(ConfigError, match="batch size of at least 1"):
        whole_batch_sizes(100, [1.0, 1.0], 0)


def test_only_gradient_averaging_steps_in_lockstep() -> None:
    """What decides whole-batch rounds: a strategy's ``lockstep`` (its workers take every step together)."""
    assert ddlf.GradientAveraging.lockstep
    assert not ddlf.ModelAveraging.lockstep and not ddlf.Asynchronous.lockstep


@pytest.mark.parametrize("rows", [12000, 12010, 97])
def test_gradient_averaging_splits_a_round_in_whole_batches(rows: int) -> None:
    """Gradient averaging, one round per epoch: each worker's part a multiple of the batch but for one worker's
    last batch (a compiled step compiles one partial shape, on one worker)."""
    cfg = TrainConfig(epochs=1, batch_size=32, strategy=ddlf.GradientAveraging(), run=ddlf.RunConfig(seed=1))
    parts = SlicePlan(rows, 2, cfg, epoch=0).next_round([0, 1])
    lengths = [len(p.indices) for _, p in parts]
    assert sum(lengths) == rows and sum(1 for n in lengths if n % 32) == (1 if rows % 32 else 0)


def test_model_averaging_splits_rows_evenly() -> None:
    """Each model-averaging worker counts its own optimizer steps: an even split keeps them equal."""
    cfg = TrainConfig(epochs=1, batch_size=32, strategy=ddlf.ModelAveraging(), run=ddlf.RunConfig(seed=1))
    assert [len(p.indices) for _, p in SlicePlan(12000, 2, cfg, epoch=0).next_round([0, 1])] == [6000, 6000]


def test_shard_layout_rotates_and_seeds_per_shard() -> None:
    assert shard_layout(3, 0, 7, None).shards == [0, 1, 2]
    assert shard_layout(3, 5, 7, None).shards == [0, 1, 2]
    assert shard_layout(3, 2, 7, 2).shards == [1, 2, 0]
    assert shard_layout(3, 2, 7, 2).seeds == [7 * SHARD_SEED_STRIDE + s for s in (1, 2, 0)]


def test_a_shard_plan_walks_each_shard_and_skips_lost_ones() -> None:
    cfg = TrainConfig(epochs=1, batch_size=4, strategy=ddlf.ModelAveraging(every=2))
    plan = ShardPlan([20, 13], cfg, epoch=0)
    seen: dict[int, list[int]] = {0: [], 1: []}
    while not plan.finished():
        for _w, part in plan.next_round([0, 1, 5]):  # worker 5 joined later: no shard of its own
            seen[part.shard] += part.indices.tolist()
    assert sorted(seen[0]) == list(range(20)) and sorted(seen[1]) == list(range(13))
    # Worker 0 lost: only worker 1 is given rows, from the shard it holds, a round's worth (2 batches of 4).
    fresh = ShardPlan([20, 13], cfg, epoch=0)
    [(w, part)] = fresh.next_round([1])
    assert w == 1 and part.shard == 1 and len(part.indices) == 8 and set(part.indices.tolist()) <= set(range(13))


def test_chunks_cut_an_epoch() -> None:
    q = chunks(np.arange(10), 4, shard=2)
    assert [c.tolist() for c, _ in q] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and {s for _, s in q} == {2}
