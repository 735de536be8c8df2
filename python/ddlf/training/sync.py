"""Synchronous training by parameter averaging.

Each round the master broadcasts its weights once (serialized once, sent to every worker concurrently); each
worker trains ``averaging_frequency`` batches (default: its whole share of the epoch, one round per epoch) and
returns its weights; the master averages them in Rust, weighted by the samples each worker trained. With
``average_optimizer_state`` the optimizer state (Adam moments) is averaged and sent back too, as
Deeplearning4j's ``saveUpdater`` does. Same seed, data and config: same final weights.

Which rows a round trains: the epoch's seeded permutation is consumed from the front, each round taking
``averaging_frequency * batch_size`` rows per live worker and splitting them among the live workers (by
``worker_shares``). Sharded datasets: each worker walks a permutation of its own shard instead.

Faults: a worker lost during a round (killed, stopped, cut off) is detected by its broken connection or by the
heartbeat timeout; the round completes with the survivors and the average is **re-weighted** over the samples
they trained (the lost worker's rows of that round are not retried this epoch). Re-weighting keeps the round's
wall time bounded by the heartbeat timeout instead of adding a second pass over the lost rows; and because the
next rounds split the rest of the permutation among the live workers, the lost worker's share of the epoch is
re-split among the survivors from the next round on. Lost workers are retried between rounds; one that comes
back (or a restarted daemon, or one added with ``cluster.add_worker``) is set up and takes part in the next
round.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .. import ops
from ..errors import WorkerUnavailable
from ..history import History, RoundStats
from . import checkpoint
from . import worker as remote
from .common import TrainConfig, average_states, decode_payload, end_epoch, nbytes, weighted_logs
from .membership import Members


def train_sync(
    app: Any,
    cfg: TrainConfig,
    history: History,
    callbacks: list[Any],
    initial_epoch: int,
    validation_data: Any,
    members: Members,
    resumed: dict[str, Any] | None = None,
) -> History:
    cluster = app.cluster
    weights = [np.ascontiguousarray(w) for w in app.model.get_weights()]
    opt_state: list[np.ndarray] | None = resumed.get("optimizer_state") if resumed else None
    round_no = len({(s.epoch, s.round) for s in history.stats})
    for epoch in range(initial_epoch, cfg.epochs):
        members.epoch = epoch
        t_epoch = time.perf_counter()
        for cb in callbacks:
            cb.on_epoch_begin(epoch)
        plan: _SlicePlan | _ShardPlan = _ShardPlan(app, cfg, epoch) if app.sharded else _SlicePlan(app, cfg, epoch)
        epoch_results: list[dict[str, Any]] = []
        done = 0
        while not plan.finished():
            members.round = round_no
            live = members.live() or members.wait_for_any(cfg.rejoin_timeout)
            assignments = plan.next_round(live)
            if not assignments:
                continue
            targets = [w for w, _ in assignments]
            t0 = time.perf_counter()
            sent_ok = cluster.set("__ddlf_weights", weights, workers=targets, return_exceptions=True)
            send_s = cluster.last_call_timings()
            t_sent = time.perf_counter()
            args, kwargs, running = [], [], []
            for (w, extra), ok in zip(assignments, sent_ok):
                if isinstance(ok, BaseException):
                    _fail(ok)
                    history.stats.append(
                        RoundStats(epoch, round_no, w, 0, 0.0, 0.0, 0.0, 0, 0, lost=True, start=t0 - cfg.t0)
                    )
                    continue
                kw: dict[str, Any] = {
                    "batch_size": cfg.batch_size,
                    "return_delta": cfg.compression is not None,
                    "compression": cfg.compression,
                    "prefetch": cfg.prefetch,
                    "return_optimizer_state": cfg.average_optimizer_state,
                    "optimizer_state": opt_state,
                    "topk_ratio": cfg.topk_ratio,
                    **extra,
                }
                if cfg.slow_worker and cfg.slow_worker[0] == w:
                    kw["slow_seconds_per_batch"] = cfg.slow_worker[1]
                indices = kw.pop("indices")
                args.append((cfg.run_id, indices))
                kwargs.append(kw)
                running.append(w)
            outcomes = (
                cluster.run_each(remote.train_chunk, args, kwargs, workers=running, return_exceptions=True)
                if running
                else []
            )
            call_s = cluster.last_call_timings()
            wall = time.perf_counter() - t0
            results: list[tuple[int, dict[str, Any]]] = []
            for w, out in zip(running, outcomes):
                if isinstance(out, BaseException):
                    _fail(out)
                    history.stats.append(
                        RoundStats(epoch, round_no, w, 0, 0.0, wall, 0.0, 0, 0, lost=True, start=t0 - cfg.t0)
                    )
                    continue
                results.append((w, out))
            members.live()  # copies the loss events into History now, with this round's number
            live_results = [res for _, res in results if res["samples"] > 0]
            if live_results:
                payloads = [decode_payload(res["weights"], weights) for res in live_results]
                merged = ops.weighted_average(payloads, [res["samples"] for res in live_results])
                if cfg.compression is not None:  # workers sent deltas
                    ops.axpy_(weights, merged)
                else:
                    weights = merged
                if cfg.average_optimizer_state:
                    opt_state = average_states(
                        [res["optimizer_state"] for res in live_results], [res["samples"] for res in live_results]
                    )
            sent = nbytes(weights) + (nbytes(opt_state) if opt_state else 0)
            for w, res in results:
                history.stats.append(
                    RoundStats(
                        epoch=epoch,
                        round=round_no,
                        worker=w,
                        samples=res["samples"],
                        compute_seconds=res["compute_seconds"],
                        wait_seconds=max(0.0, wall - (t_sent - t0) - call_s.get(w, (0.0, 0.0))[1]),
                        data_wait_seconds=res["data_wait_seconds"],
                        bytes_sent=sent,
                        bytes_received=nbytes(res["weights"]) + nbytes(res.get("optimizer_state")),
                        start=t0 - cfg.t0,
                        send_seconds=send_s.get(w, (0.0, t_sent - t0))[1],
                        comm_seconds=max(0.0, call_s.get(w, (0.0, 0.0))[1] - res["compute_seconds"]),
                    )
                )
            epoch_results += [res for _, res in results]
            done += sum(res["samples"] for _, res in results)
            round_logs = weighted_logs(live_results) if live_results else {}
            round_logs["samples_done"] = done
            for cb in callbacks:
                cb.on_round_end(round_no, round_logs)
            round_no += 1
        stop = end_epoch(app, weights, epoch_results, epoch, t_epoch, history, callbacks, validation_data)
        if cfg.checkpoint_dir:
            save_checkpoint(app, cfg, members, epoch + 1, weights, opt_state, history, "sync")
        if stop:
            break
    return history


def _fail(exc: BaseException) -> None:
    """A worker's failure in a round: a lost worker is left out (the cluster marked it and warned); anything
    else (a bug in user code, a bad argument) stops training."""
    if not isinstance(exc, WorkerUnavailable):
        raise exc


def save_checkpoint(
    app: Any,
    cfg: TrainConfig,
    members: Members,
    epochs_done: int,
    weights: list[np.ndarray],
    opt_state: list[np.ndarray] | None,
    history: History,
    mode: str,
) -> None:
    """Write the run's checkpoint, with each live worker's own state (optimizer, random generators)."""
    cluster = app.cluster
    live = members.live()
    states = cluster.call(remote.session_state, (cfg.run_id,), workers=live, return_exceptions=True)
    worker_states = {w: s for w, s in zip(live, states) if not isinstance(s, BaseException)}
    checkpoint.save(
        cfg.checkpoint_dir,
        epochs_done=epochs_done,
        mode=mode,
        seed=cfg.seed,
        weights=[np.asarray(w) for w in weights],
        optimizer_state=opt_state,
        worker_states=worker_states,
        history=history,
    )


class _SlicePlan:
    """The whole dataset on every worker: one seeded permutation per epoch, consumed round by round by the
    workers live at that round (``indices``: the master sends each its slice; ``seeded``: only the slice's
    bounds, and the worker regenerates the permutation)."""

    def __init__(self, app: Any, cfg: TrainConfig, epoch: int) -> None:
        self.cfg, self.epoch = cfg, epoch
        self.rows = app._rows
        self.n_workers = len(app.cluster)
        self.offset = 0
        self.perm = ops.permutation(self.rows, cfg.seed, epoch) if cfg.shuffle == "indices" else None
        self.per_worker = (cfg.averaging_frequency or 0) * cfg.batch_size  # 0: the whole epoch in one round

    def finished(self) -> bool:
        return self.offset >= self.rows

    def next_round(self, live: list[int]) -> list[tuple[int, dict[str, Any]]]:
        left = self.rows - self.offset
        total = min(left, self.per_worker * len(live)) if self.per_worker else left
        shares = self.cfg.shares if self.cfg.shares and len(self.cfg.shares) == self.n_workers else None
        sizes = ops.split_sizes(total, [shares[w] for w in live] if shares else [1.0] * len(live))
        out = []
        lo = self.offset
        for w, n in zip(live, sizes):
            hi = lo + int(n)
            if self.perm is not None:
                out.append((w, {"indices": self.perm[lo:hi]}))
            else:
                out.append((w, {"indices": None, "seeded": (self.cfg.seed, self.epoch, [1.0], 0, lo, hi)}))
            lo = hi
        self.offset = lo
        return out


class _ShardPlan:
    """A sharded dataset: each worker shuffles within the shard it holds (with rotation, the shard of worker
    ``(w + epoch // k) % n``), from a per-shard seed, ``averaging_frequency`` batches per round. A lost worker's
    shard is skipped until it is back (only it holds those rows)."""

    def __init__(self, app: Any, cfg: TrainConfig, epoch: int) -> None:
        self.cfg, self.epoch = cfg, epoch
        n = len(app._shard_rows)
        k = cfg.rotate_shards_every
        self.shards = [(w + (epoch // k if k else 0)) % n for w in range(n)]
        self.seeds = [cfg.seed * 1_000_003 + s for s in self.shards]
        self.sizes = [app._shard_rows[s] for s in self.shards]
        self.perms = (
            [ops.permutation(m, seed, epoch) for m, seed in zip(self.sizes, self.seeds)]
            if cfg.shuffle == "indices"
            else None
        )
        self.per_round = (cfg.averaging_frequency or 0) * cfg.batch_size or max(self.sizes)
        self.n_rounds = max(1, -(-max(self.sizes) // self.per_round))
        self.r = 0

    def finished(self) -> bool:
        return self.r >= self.n_rounds

    def next_round(self, live: list[int]) -> list[tuple[int, dict[str, Any]]]:
        start, stop = self.r * self.per_round, (self.r + 1) * self.per_round
        self.r += 1
        out = []
        for w in live:
            if w >= len(self.shards):
                continue  # added after the shards were laid out: no shard of its own
            extra: dict[str, Any] = {"shard": self.shards[w]}
            if self.perms is not None:
                extra["indices"] = self.perms[w][start:stop]
            else:
                extra["indices"] = None
                extra["seeded"] = (self.seeds[w], self.epoch, [1.0], 0, start, stop)
            out.append((w, extra))
        return out
