"""Which rows each worker trains, round by round: the epoch's plans.

The master never sends data, only indices (or, with ``shuffle="seeded"``, the bounds of a slice of a permutation
each worker regenerates). Two layouts:

* :class:`SlicePlan`: the whole dataset on every worker; one seeded permutation per epoch, consumed from the front
  by the workers live at each round.
* :class:`ShardPlan`: each worker holds a shard (rotating every ``rotate_shards_every`` epochs) and walks a
  permutation of it.

:func:`shard_layout` is the one rotation and seed formula both loops use; :func:`chunks` cuts an epoch into the
asynchronous loop's queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .. import ops
from ..errors import ConfigError
from .messages import Rows
from .options import TrainConfig

SHARD_SEED_STRIDE = 1_000_003
"""Shard ``s`` of a run with seed ``seed`` is shuffled from seed ``seed * SHARD_SEED_STRIDE + s``."""


@dataclass(frozen=True)
class ShardLayout:
    """Which shard each worker position holds in one epoch, and the seed of its permutation."""

    shards: list[int]
    seeds: list[int]


def shard_layout(n_shards: int, epoch: int, seed: int, rotate_every: int | None) -> ShardLayout:
    """Worker ``w`` holds shard ``(w + epoch // k) % n`` (no rotation without ``k``)."""
    shift = epoch // rotate_every if rotate_every else 0
    shards = [(w + shift) % n_shards for w in range(n_shards)]
    return ShardLayout(shards, [seed * SHARD_SEED_STRIDE + s for s in shards])


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order an epoch visits ``n`` rows in: the seeded permutation for ``(seed, epoch)``, or (``fit``'s
    ``shuffle=False``) ``0, 1, ..., n - 1``."""
    return ops.permutation(n, seed, epoch) if shuffle else np.arange(n, dtype=np.uint32)


Assignment = tuple[int, Rows]
"""One worker's part of a round: ``(worker, the rows it trains)``."""


def assigned_rows(part: Rows) -> int:
    """The most rows an assignment's worker can train: its indices, or its slice's bounds (``seeded``)."""
    return part.count()


def whole_batch_sizes(total: int, shares: list[float], batch_size: int) -> list[int]:
    """How many of a round's ``total`` rows each worker trains: whole batches, split by ``shares``, and the one
    partial batch (``total`` not a multiple of ``batch_size``) to the worker with the fewest rows.

    As ``fit`` on one process, at most one batch of the round is partial: a step compiled for a batch's shape
    (Keras on JAX, ``torch.compile``) is compiled for one partial shape on one worker, not on every worker (an even
    split of 12,000 rows in batches of 32 on 2 workers gives each a last batch of 16; this gives 6,016 and 5,984
    rows, all in whole batches)."""
    if batch_size < 1:
        raise ConfigError(f"whole_batch_sizes needs a batch size of at least 1, got {batch_size}")
    full, rest = divmod(total, batch_size)
    sizes = [int(n) * batch_size for n in ops.split_sizes(full, shares)]
    if rest:
        sizes[sizes.index(min(sizes))] += rest
    return sizes


class SlicePlan:
    """The whole dataset on every worker: one seeded permutation per epoch, consumed round by round by the
    workers live at that round (``indices``: the master sends each its slice; ``seeded``: only the slice's
    bounds, and the worker regenerates the permutation).

    Where the strategy's workers step in lockstep (``lockstep``: gradient averaging), each worker's part of a round
    is whole batches but for at most one partial batch in the round (:func:`whole_batch_sizes`): every worker
    takes every step anyway. Otherwise (model averaging) rows split evenly: there each worker's optimizer counts
    its own steps (Adam's bias correction, a backup's step count), which an uneven split would make differ from
    worker to worker."""

    def __init__(self, rows: int, n_workers: int, cfg: TrainConfig, epoch: int) -> None:
        self.cfg, self.epoch = cfg, epoch
        self.rows = rows
        self.n_workers = n_workers
        self.offset = 0
        shuffle = cfg.fit.shuffle
        self.perm = epoch_order(rows, cfg.run.seed, epoch, shuffle) if cfg.data.send == "indices" else None
        self.per_worker = (cfg.round_batches or 0) * cfg.batch_size  # 0: the whole epoch in one round
        self.lockstep = cfg.strategy.lockstep

    def finished(self) -> bool:
        return self.offset >= self.rows

    def progress(self) -> float:
        """The share of the epoch's rows handed out so far (0 to 1)."""
        return self.offset / self.rows if self.rows else 1.0

    def position(self) -> int:
        """Rows handed out so far this epoch (what :meth:`seek` takes back)."""
        return self.offset

    def seek(self, position: int) -> None:
        """Go on from ``position`` rows into the epoch (a run resumed after a preemption)."""
        self.offset = min(max(0, int(position)), self.rows)

    def next_round(self, live: list[int]) -> list[Assignment]:
        left = self.rows - self.offset
        total = min(left, self.per_worker * len(live)) if self.per_worker else left
        given = self.cfg.data.worker_shares
        shares = list(given) if given and len(given) == self.n_workers else None
        split = [shares[w] for w in live] if shares else [1.0] * len(live)
        if self.lockstep:
            sizes = whole_batch_sizes(total, split, self.cfg.batch_size)
        else:
            sizes = [int(n) for n in ops.split_sizes(total, split)]
        out: list[Assignment] = []
        lo = self.offset
        for w, n in zip(live, sizes):
            hi = lo + int(n)
            if self.perm is not None:
                out.append((w, Rows(indices=self.perm[lo:hi])))
            else:
                out.append((w, Rows(seeded=(self.cfg.run.seed, self.epoch, [1.0], 0, lo, hi))))
            lo = hi
        self.offset = lo
        return out


class ShardPlan:
    """A sharded dataset: each worker shuffles within the shard it holds, ``ModelAveraging.every`` batches per
    round. A lost worker's shard is skipped until it is back (only it holds those rows)."""

    def __init__(self, shard_rows: list[int], cfg: TrainConfig, epoch: int) -> None:
        self.cfg, self.epoch = cfg, epoch
        layout = shard_layout(len(shard_rows), epoch, cfg.run.seed, cfg.data.rotate_shards_every)
        self.shards, self.seeds = layout.shards, layout.seeds
        self.sizes = [shard_rows[s] for s in self.shards]
        self.perms = (
            [epoch_order(m, seed, epoch, cfg.fit.shuffle) for m, seed in zip(self.sizes, self.seeds)]
            if cfg.data.send == "indices"
            else None
        )
        self.per_round = (cfg.round_batches or 0) * cfg.batch_size or max(self.sizes)
        self.n_rounds = max(1, -(-max(self.sizes) // self.per_round))
        self.r = 0

    def finished(self) -> bool:
        return self.r >= self.n_rounds

    def progress(self) -> float:
        """The share of the epoch's rounds handed out so far (0 to 1)."""
        return self.r / self.n_rounds

    def position(self) -> int:
        """Rounds handed out so far this epoch (what :meth:`seek` takes back)."""
        return self.r

    def seek(self, position: int) -> None:
        """Go on from round ``position`` of the epoch (a run resumed after a preemption)."""
        self.r = min(max(0, int(position)), self.n_rounds)

    def next_round(self, live: list[int]) -> list[Assignment]:
        start, stop = self.r * self.per_round, (self.r + 1) * self.per_round
        self.r += 1
        out: list[Assignment] = []
        for w in live:
            if w >= len(self.shards):
                continue  # added after the shards were laid out: no shard of its own
            if self.perms is not None:
                rows = Rows(indices=self.perms[w][start:stop], shard=self.shards[w])
            else:
                rows = Rows(seeded=(self.seeds[w], self.epoch, [1.0], 0, start, stop), shard=self.shards[w])
            out.append((w, rows))
        return out


Chunk = tuple[np.ndarray, int | None]
"""A piece of the asynchronous queue: its rows, and the shard they index (None: the whole dataset)."""


def chunks(perm: np.ndarray, chunk_rows: int, shard: int | None = None) -> deque[Chunk]:
    """An epoch's permutation cut into the asynchronous loop's queue of chunks."""
    return deque((perm[i : i + chunk_rows], shard) for i in range(0, len(perm), chunk_rows))
