"""Asynchronous training: every worker at its own pace.

Each epoch's permutation is cut into chunks of ``Asynchronous.chunk`` batches (default: 2 on two workers, 1 on
more, :meth:`~.options.Asynchronous.chunk_batches`), queued, and each
worker repeatedly takes the next chunk, pulls the newest global weights with their version, trains, and pushes
its delta. The master applies each delta atomically (in Rust, in place) and bumps the version. A delta computed
from weights ``s`` versions old has staleness ``s``: with ``staleness=DynSGD()`` it is scaled by ``1/(s+1)``;
beyond ``max_staleness`` it is dropped and the worker simply pulls fresh weights for its next chunk. A slow worker
takes fewer chunks and never stalls the others. With a sharded dataset each worker works through its own shard
(only it holds those rows), so the epoch ends when the slowest worker's shard is done.

Faults: a lost worker's chunk goes back to the front of the queue and the others carry on (with a sharded
dataset they also take over the lost worker's shard, loading it on first use). A supervisor retries lost
workers and starts a worker that comes back, restarts, or is added to the cluster, within the same epoch.

Preemption (:mod:`.preemption`): no new chunk is handed out, the chunks in flight finish, and the checkpoint
records how many rows of the epoch's order were trained; the resumed run trains the rest of that epoch (with
any number of workers), as the synchronous loop does.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import ops
from ..errors import BadWorkerReply, WorkerUnavailable
from . import replica as remote
from .history import History, RoundStats
from .membership import Members
from .messages import MasterRound, Rows, WorkerResult
from .numerics import nbytes
from .options import Asynchronous, TrainConfig
from .plan import Chunk, chunks, epoch_order, shard_layout
from .policy import stopping
from .replies import check_reply
from .run import TrainingRun

SUPERVISE_EVERY = 0.2  # seconds between the supervisor's looks at the workers


@dataclass
class _Epoch:
    """The shared state of one asynchronous epoch: chunks left, results so far."""

    epoch: int
    chunks: deque[Chunk]  # a shared queue of the whole dataset
    own: dict[int, deque[Chunk]] = field(default_factory=dict)  # sharded: one queue per shard
    results: list[WorkerResult] = field(default_factory=list)
    done: int = 0
    in_flight: int = 0
    shard_of: dict[int, int] = field(default_factory=dict)  # sharded: worker -> the shard it works through
    lost: set[int] = field(default_factory=set)  # workers lost during this epoch
    rows: int = 0  # the rows of the epoch's whole order (the shared queue holds its part not trained yet)
    pushed_back: bool = False  # a chunk went back to the front of a queue (its worker was lost)

    def take(self, w: int) -> tuple[np.ndarray, int | None, Any] | None:
        """The next chunk for worker ``w`` (see :meth:`queue_for`), with the queue it came from."""
        queue = self.queue_for(w)
        return (*queue.popleft(), queue) if queue is not None else None

    def queue_for(self, w: int) -> deque[Chunk] | None:
        """Where worker ``w``'s next chunk comes from: the shared queue, or its own shard's queue, then a lost
        worker's shard's; ``None``: nothing for it now."""
        if not self.own:
            return self.chunks if self.chunks else None
        mine = self.own.get(self.shard_of.get(w, -1))
        if mine:
            return mine
        for s, queue in self.own.items():
            owner = next((x for x, sh in self.shard_of.items() if sh == s), None)
            if queue and (owner is None or owner in self.lost):
                return queue
        return None

    def remaining(self) -> int:
        return len(self.chunks) + sum(len(q) for q in self.own.values())

    def position(self) -> int:
        """Rows of the epoch's order trained (or refused, here or by the run this one resumed) before the
        queue's first chunk; 0 where those are not a prefix of the order (a chunk went back to the queue's front,
        or each worker has a shard's queue of its own): the epoch is then trained again."""
        if self.own or self.pushed_back:
            return 0
        return self.rows - sum(len(c) for c, _ in self.chunks)


def train_async(run: TrainingRun) -> History:
    """The asynchronous loop: one thread per live worker takes chunks off the epoch's queue."""
    app, cfg, history, cluster, members = run.app, run.cfg, run.history, run.cluster, run.members
    strategy = cfg.strategy
    assert isinstance(strategy, Asynchronous)
    weights = [np.require(w, requirements="C") for w in app.model.get_weights()]
    lock = threading.Lock()
    state: dict[str, Any] = {"version": 0, "round": 0, "begun": 0, "error": None}
    for epoch in range(run.initial_epoch, cfg.epochs):
        t_epoch = run.begin_epoch(epoch)
        take_edits(run, weights)
        chunk_rows = strategy.chunk_batches(len(members.live())) * cfg.batch_size
        if app.sharded:
            # Each worker works through the shard it holds (rotating every k epochs if asked).
            layout = shard_layout(len(run.shard_rows), epoch, cfg.run.seed, cfg.data.rotate_shards_every)
            own = {
                shard: chunks(epoch_order(run.shard_rows[shard], seed, epoch, cfg.fit.shuffle), chunk_rows, shard)
                for shard, seed in zip(layout.shards, layout.seeds)
            }
            ep = _Epoch(epoch, deque(), own, shard_of=dict(enumerate(layout.shards)))
        else:
            order = epoch_order(run.rows, cfg.run.seed, epoch, cfg.fit.shuffle)
            start = run.resume_position if epoch == run.initial_epoch else 0
            # a preempted run goes on after the rows its last chunks trained (the sync loop does the same)
            ep = _Epoch(epoch, chunks(order[start:], chunk_rows), rows=len(order))

        def work(address: str, ep: _Epoch) -> bool:
            """Train chunks on the worker at ``address`` until none is left for it; whether a call failed."""
            while True:
                try:
                    w = cluster.addresses.index(address)
                except ValueError:
                    return False  # removed from the cluster
                with lock:
                    if state["error"] is not None or run.preempted() or app.stop_training:
                        # preempted or stopped by a callback: no new chunk; those in flight finish (or fail with
                        # their workers)
                        return False
                    item = ep.take(w)
                    if item is None:
                        return False
                    chunk, shard, queue = item
                    ep.in_flight += 1
                    start_weights = [a.copy() for a in weights]
                    version = state["version"]
                    begun = state["begun"]  # chunks in flight at once each open a round of their own
                    state["begun"] += 1
                try:
                    run.round_begin(begun)
                except BaseException as exc:  # a callback's error ends the run, as in the sync loop
                    with lock:
                        ep.in_flight -= 1
                        queue.appendleft((chunk, shard))  # not trained
                        state["error"] = exc
                    return False
                t0 = time.perf_counter()
                spec = MasterRound(
                    run_id=run.state.run_id,
                    rows=Rows(indices=chunk, shard=shard),
                    batch_size=cfg.batch_size,
                    prefetch=cfg.data.prefetch,
                    compression=cfg.compression,
                    slow_seconds_per_batch=run.state.slow_seconds(w),
                    weights=start_weights,
                    return_delta=True,
                    topk_ratio=cfg.topk_ratio,
                    learning_rate=run.learning_rate(),
                    optimizer_groups=run.optimizer_groups(),
                )
                res = cluster.call(remote.train_chunk, (spec,), workers=[w], return_exceptions=True)[0]
                call_s = cluster.last_call_timings().get(w, (0.0, 0.0))[1]
                wall = time.perf_counter() - t0
                if isinstance(res, BaseException):
                    with lock:
                        ep.in_flight -= 1
                        queue.appendleft((chunk, shard))  # nothing is lost: another worker trains it
                        ep.pushed_back = True
                        if stopping(res):  # SIGTERM: it refuses chunks while it drains (ddlf.worker.drain)
                            run.members.stopped(res)
                            ep.lost.add(w)
                        if run.policy.decide(res) == "raise":
                            state["error"] = res  # surfaced by the master thread
                        elif isinstance(res, WorkerUnavailable):
                            ep.lost.add(w)
                            run.lost(ep.epoch, state["round"], w, wall, t0)
                    return True  # the call failed: retried at the supervisor's next look
                try:
                    res = check_reply(w, res, start_weights, rows=len(chunk), compression=cfg.compression)
                except BadWorkerReply as exc:
                    with lock:
                        ep.in_flight -= 1  # its rows are not trained again this epoch, as in a sync round
                        try:
                            run.refuse(exc)
                        except BadWorkerReply as fatal:  # nonfinite="raise"
                            state["error"] = fatal
                            return False
                    continue
                delta = res.payload
                with lock:
                    ep.in_flight -= 1
                    staleness = state["version"] - version
                    dropped = strategy.max_staleness is not None and staleness > strategy.max_staleness
                    if not dropped:
                        scale = 1.0 / (staleness + 1) if strategy.staleness is not None else 1.0
                        ops.axpy_(weights, delta, scale)
                        state["version"] += 1
                    ep.results.append(res)
                    ep.done += res.samples
                    history.stats.append(
                        RoundStats(
                            epoch=ep.epoch,
                            round=state["round"],
                            worker=w,
                            samples=res.samples,
                            compute_seconds=res.compute_seconds,
                            wait_seconds=max(0.0, wall - call_s),
                            data_wait_seconds=res.data_wait_seconds,
                            bytes_sent=nbytes(start_weights),
                            bytes_received=nbytes(res.weights),
                            staleness=staleness,
                            dropped=dropped,
                            start=t0 - run.state.t0,
                            comm_seconds=max(0.0, call_s - res.compute_seconds),
                        )
                    )
                    state["round"] += 1
                    round_no = state["round"]
                    logs = dict(res.logs, samples_done=ep.done)
                try:
                    run.round_end(round_no, logs)
                except BaseException as exc:  # surfaced by the master thread (a thread's error was only printed)
                    with lock:
                        state["error"] = exc
                    return False

        _supervise(cluster, members, ep, work, lock, state, cfg, lambda: run.preempted() or bool(app.stop_training))
        if state["error"] is not None:
            raise state["error"]
        # Preempted mid-epoch: the weights so far are kept, and the resumed run goes on after the rows trained
        # (or trains the epoch again where those are not a prefix of its order: _Epoch.position).
        run.stop_if_preempted(epoch, ep.position(), weights, None, "async")
        members.live()  # record this epoch's events in History
        stop = run.end_epoch(weights, ep.results, epoch, t_epoch)
        take_edits(run, weights)
        run.save_checkpoint(epoch + 1, weights, None, "async")
        if stop:
            break
    return history


def take_edits(run: TrainingRun, weights: list[np.ndarray]) -> None:
    """A callback set the master's weights (:meth:`.run.TrainingRun.edited_weights`): the chunks train on from
    them (in ``weights``, the list the worker threads read)."""
    edited = run.edited_weights(weights)
    if edited is not None:
        weights[:] = edited


def _supervise(
    cluster: Any,
    members: Members,
    ep: _Epoch,
    work: Any,
    lock: threading.Lock,
    state: dict[str, Any],
    cfg: TrainConfig,
    preempted: Callable[[], bool],
) -> None:
    """Run one worker thread per live worker until the epoch's chunks are done (or, once ``preempted()``, the
    chunks in flight: preempted, or a callback set ``stop_training``); start threads for workers that join during
    the epoch; wait for a lost cluster to come back for up to ``rejoin_timeout``."""
    threads: dict[str, threading.Thread] = {}
    active: set[str] = set()  # workers whose thread has not ended (under ``lock``)
    failed_at: dict[str, float] = {}  # when a worker's thread last ended on a failed call
    alone_since: float | None = None
    wake = threading.Event()  # set as each worker thread ends: its end may end the epoch, or need a new thread

    def run(address: str) -> None:
        failed = False
        try:
            failed = bool(work(address, ep))
        finally:
            with lock:
                active.discard(address)
                if failed:
                    failed_at[address] = time.monotonic()
            wake.set()

    while True:
        wake.clear()  # before the state is read: a thread that ends after this read wakes the wait below
        with lock:
            remaining, in_flight, failed = ep.remaining(), ep.in_flight, state["error"] is not None
            if preempted():
                remaining = 0
            running = bool(active)
        if failed or (remaining == 0 and in_flight == 0 and not running):
            break
        if remaining:
            live = members.live()
            now = time.monotonic()
            start = []
            with lock:
                ep.lost.difference_update(live)
                for w in live:
                    address = cluster.addresses[w]
                    # A thread per worker that has something to take (not one whose shard is done while others'
                    # are not), and after a failed call only at the next look (no retry in a tight loop).
                    if address in active or ep.queue_for(w) is None:
                        continue
                    if address in failed_at and now - failed_at[address] < SUPERVISE_EVERY:
                        continue
                    active.add(address)
                    start.append((w, address))
            for w, address in start:
                t = threading.Thread(target=run, args=(address,), name=f"ddlf-async-{w}", daemon=True)
                threads[address] = t
                t.start()
            if not live and not running:
                alone_since = alone_since or time.monotonic()
                alone = time.monotonic() - alone_since
                if alone > cfg.run.rejoin_timeout:
                    members.wait_for_any(0.0, waited=alone)  # raises, naming the workers
            else:
                alone_since = None
        # Until a worker thread ends (the epoch may be over: no fixed wait at its end), or the next look at the
        # cluster (a worker that came back, a failed one's retry, preemption).
        wake.wait(SUPERVISE_EVERY)
    for t in threads.values():
        t.join()
