"""Synchronous training by parameter averaging.

Each round the master broadcasts its weights once (serialized once, sent to every worker concurrently); each
worker trains ``averaging_frequency`` batches of its partition of the epoch's permutation (default: the whole
partition, one round per epoch) and returns its weights; the master averages them in Rust, weighted by the
samples each worker trained. With ``average_optimizer_state`` the optimizer state (Adam moments) is averaged and
sent back too, as Deeplearning4j's ``saveUpdater`` does. Same seed, data and config: same final weights.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .. import ops
from ..history import History, RoundStats
from . import worker as remote
from .common import TrainConfig, average_states, decode_payload, end_epoch, nbytes, weighted_logs


def train_sync(
    app: Any, cfg: TrainConfig, history: History, callbacks: list[Any], initial_epoch: int, validation_data: Any
) -> History:
    cluster = app.cluster
    n_workers = len(cluster)
    shares = cfg.shares or [1.0] * n_workers
    rows = app._rows
    weights = [np.ascontiguousarray(w) for w in app.model.get_weights()]
    opt_state: list[np.ndarray] | None = None
    round_no = 0
    for epoch in range(initial_epoch, cfg.epochs):
        t_epoch = time.perf_counter()
        for cb in callbacks:
            cb.on_epoch_begin(epoch)
        plan = _EpochPlan(app, cfg, epoch, shares, rows, n_workers)
        sizes = plan.sizes
        per_round = (cfg.averaging_frequency or 0) * cfg.batch_size or max(sizes)
        n_rounds = max(1, -(-max(sizes) // per_round))
        epoch_results = []
        done = 0
        for r in range(n_rounds):
            start, stop = r * per_round, (r + 1) * per_round
            t0 = time.perf_counter()
            cluster.set("__ddlf_weights", weights)
            args = []
            for w in range(n_workers):
                kw: dict[str, Any] = {
                    "batch_size": cfg.batch_size,
                    "return_delta": cfg.compression is not None,
                    "compression": cfg.compression,
                    "prefetch": cfg.prefetch,
                    "return_optimizer_state": cfg.average_optimizer_state,
                    "optimizer_state": opt_state,
                    "topk_ratio": cfg.topk_ratio,
                }
                if cfg.slow_worker and cfg.slow_worker[0] == w:
                    kw["slow_seconds_per_batch"] = cfg.slow_worker[1]
                args.append(((cfg.run_id, plan.indices(w, start, stop)), kw))
                kw.update(plan.extra(w, start, stop))
            results = cluster.run_each(remote.train_chunk, [a for a, _ in args], [k for _, k in args])
            wall = time.perf_counter() - t0
            live = [res for res in results if res["samples"] > 0]
            if live:
                payloads = [decode_payload(res["weights"], weights) for res in live]
                merged = ops.weighted_average(payloads, [res["samples"] for res in live])
                if cfg.compression is not None:  # workers sent deltas
                    ops.axpy_(weights, merged)
                else:
                    weights = merged
                if cfg.average_optimizer_state:
                    opt_state = average_states(
                        [res["optimizer_state"] for res in live], [res["samples"] for res in live]
                    )
            sent = nbytes(weights) + (nbytes(opt_state) if opt_state else 0)
            for w, res in enumerate(results):
                history.stats.append(
                    RoundStats(
                        epoch=epoch,
                        round=round_no,
                        worker=w,
                        samples=res["samples"],
                        compute_seconds=res["compute_seconds"],
                        wait_seconds=max(0.0, wall - res["compute_seconds"]),
                        data_wait_seconds=res["data_wait_seconds"],
                        bytes_sent=sent,
                        bytes_received=nbytes(res["weights"]) + nbytes(res.get("optimizer_state")),
                    )
                )
            epoch_results += results
            done += sum(res["samples"] for res in results)
            round_logs = weighted_logs(live) if live else {}
            round_logs["samples_done"] = done
            for cb in callbacks:
                cb.on_round_end(round_no, round_logs)
            round_no += 1
        if end_epoch(app, weights, epoch_results, epoch, t_epoch, history, callbacks, validation_data):
            break
    return history


class _EpochPlan:
    """Which rows each worker trains on in one epoch.

    Whole dataset on every worker: a seeded permutation of all rows split among the workers (``indices``: the
    master sends each worker its slice; ``seeded``: only the seed, and the worker regenerates it). Sharded
    dataset: each worker shuffles within the shard it holds (with rotation, the shard of worker
    ``(w + epoch // k) % n``), from a per-shard seed.
    """

    def __init__(self, app: Any, cfg: TrainConfig, epoch: int, shares: list[float], rows: int, n_workers: int):
        self.cfg, self.epoch = cfg, epoch
        self.sharded = bool(app.sharded)
        if self.sharded:
            k = cfg.rotate_shards_every
            self.shards = [(w + (epoch // k if k else 0)) % n_workers for w in range(n_workers)]
            self.seeds = [cfg.seed * 1_000_003 + s for s in self.shards]
            self.sizes = [app._shard_rows[s] for s in self.shards]
            self.perms = (
                [ops.permutation(n, seed, epoch) for n, seed in zip(self.sizes, self.seeds)]
                if cfg.shuffle == "indices"
                else None
            )
        else:
            self.shares = shares
            self.perms = ops.partitions(rows, cfg.seed, epoch, shares) if cfg.shuffle == "indices" else None
            self.sizes = [len(p) for p in self.perms] if self.perms is not None else ops.split_sizes(rows, shares)

    def indices(self, w: int, start: int, stop: int) -> np.ndarray | None:
        return self.perms[w][start:stop] if self.perms is not None else None

    def extra(self, w: int, start: int, stop: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.sharded:
            out["shard"] = self.shards[w]
            if self.perms is None:
                out["seeded"] = (self.seeds[w], self.epoch, [1.0], 0, start, stop)
        elif self.perms is None:
            out["seeded"] = (self.cfg.seed, self.epoch, self.shares, w, start, stop)
        return out
