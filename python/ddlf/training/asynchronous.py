"""Asynchronous training: every worker at its own pace.

Each epoch's permutation is cut into chunks of ``averaging_frequency`` batches (default: 10), queued, and each
worker repeatedly takes the next chunk, pulls the newest global weights with their version, trains, and pushes
its delta. The master applies each delta atomically (in Rust, in place) and bumps the version. A delta computed
from weights ``s`` versions old has staleness ``s``: with ``staleness="dynsgd"`` it is scaled by ``1/(s+1)``;
beyond ``max_staleness`` it is dropped and the worker simply pulls fresh weights for its next chunk. A slow worker
takes fewer chunks and never stalls the others. With a sharded dataset each worker works through its own shard
(only it holds those rows), so the epoch ends when the slowest worker's shard is done.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import ops
from ..history import History, RoundStats
from . import worker as remote
from .common import TrainConfig, decode_payload, end_epoch, nbytes

DEFAULT_CHUNK_BATCHES = 10


@dataclass
class _Epoch:
    """The shared state of one asynchronous epoch: chunks left, results so far."""

    epoch: int
    chunks: deque[tuple[np.ndarray, int | None]]  # (rows, shard): a shared queue of the whole dataset
    own: list[deque[tuple[np.ndarray, int | None]]] = field(default_factory=list)  # sharded: one queue per worker
    results: list[dict[str, Any]] = field(default_factory=list)
    done: int = 0


def train_async(
    app: Any, cfg: TrainConfig, history: History, callbacks: list[Any], initial_epoch: int, validation_data: Any
) -> History:
    cluster = app.cluster
    n_workers = len(cluster)
    rows = app._rows
    chunk_rows = (cfg.averaging_frequency or DEFAULT_CHUNK_BATCHES) * cfg.batch_size
    weights = [np.ascontiguousarray(w, dtype=w.dtype) for w in app.model.get_weights()]
    lock = threading.Lock()
    state = {"version": 0, "round": 0, "error": None}
    for epoch in range(initial_epoch, cfg.epochs):
        t_epoch = time.perf_counter()
        for cb in callbacks:
            cb.on_epoch_begin(epoch)
        if app.sharded:
            # Each worker works through the shard it holds (rotating every k epochs if asked); only it has the
            # rows, so a slow worker's shard finishes last.
            k = cfg.rotate_shards_every
            own = []
            for w in range(n_workers):
                shard = (w + (epoch // k if k else 0)) % n_workers
                n = app._shard_rows[shard]
                perm = ops.permutation(n, cfg.seed * 1_000_003 + shard, epoch)
                own.append(deque((perm[i : i + chunk_rows], shard) for i in range(0, n, chunk_rows)))
            ep = _Epoch(epoch, deque(), own)
        else:
            perm = ops.permutation(rows, cfg.seed, epoch)
            ep = _Epoch(epoch, deque((perm[i : i + chunk_rows], None) for i in range(0, rows, chunk_rows)))

        def work(w: int, ep: _Epoch) -> None:
            while True:
                with lock:
                    queue = ep.own[w] if ep.own else ep.chunks
                    if not queue or state["error"] is not None:
                        return
                    chunk, shard = queue.popleft()
                    start_weights = [a.copy() for a in weights]
                    version = state["version"]
                t0 = time.perf_counter()
                kw: dict[str, Any] = {
                    "weights": start_weights,
                    "return_delta": True,
                    "compression": cfg.compression,
                    "prefetch": cfg.prefetch,
                    "topk_ratio": cfg.topk_ratio,
                }
                if cfg.slow_worker and cfg.slow_worker[0] == w:
                    kw["slow_seconds_per_batch"] = cfg.slow_worker[1]
                if shard is not None:
                    kw["shard"] = shard
                try:
                    res = cluster.call(remote.train_chunk, (cfg.run_id, chunk, cfg.batch_size), kw, workers=[w])[0]
                except BaseException as exc:  # surfaced by the master thread
                    with lock:
                        state["error"] = exc
                    return
                wall = time.perf_counter() - t0
                delta = decode_payload(res["weights"], start_weights)
                with lock:
                    staleness = state["version"] - version
                    dropped = cfg.max_staleness is not None and staleness > cfg.max_staleness
                    if not dropped:
                        scale = 1.0 / (staleness + 1) if cfg.staleness == "dynsgd" else 1.0
                        ops.axpy_(weights, delta, scale)
                        state["version"] += 1
                    ep.results.append(res)
                    ep.done += res["samples"]
                    history.stats.append(
                        RoundStats(
                            epoch=ep.epoch,
                            round=state["round"],
                            worker=w,
                            samples=res["samples"],
                            compute_seconds=res["compute_seconds"],
                            wait_seconds=max(0.0, wall - res["compute_seconds"]),
                            data_wait_seconds=res["data_wait_seconds"],
                            bytes_sent=nbytes(start_weights),
                            bytes_received=nbytes(res["weights"]),
                            staleness=staleness,
                            dropped=dropped,
                        )
                    )
                    state["round"] += 1
                    round_no = state["round"]
                    logs = dict(res["logs"], samples_done=ep.done)
                for cb in callbacks:
                    cb.on_round_end(round_no, logs)

        threads = [threading.Thread(target=work, args=(w, ep), name=f"ddlf-async-{w}") for w in range(n_workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if state["error"] is not None:
            raise state["error"]
        if end_epoch(app, weights, ep.results, epoch, t_epoch, history, callbacks, validation_data):
            break
    return history
