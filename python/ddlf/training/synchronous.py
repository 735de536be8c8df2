"""Synchronous training by parameter averaging.

Each round the master broadcasts its weights once (serialized once, sent to every worker concurrently); each
worker trains ``ModelAveraging.every`` batches (default: its whole share of the epoch, one round per epoch) and
returns its weights; the master averages them in Rust, weighted by the samples each worker trained. With
``ModelAveraging(optimizer_state=True)`` the optimizer state (Adam moments) is averaged and sent back too, as
Deeplearning4j's ``saveUpdater`` does. Same seed, data and config: same final weights.

Which rows a round trains: the epoch's seeded permutation is consumed from the front, each round taking
``every * batch_size`` rows per live worker and splitting them among the live workers (by
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
from ..errors import BadWorkerReply
from . import replica as remote
from .exchange import RingExchange
from .history import History, RoundStats
from .messages import MasterRound, Rows, WorkerResult, weights_var
from .numerics import average_states, nbytes
from .outer import OuterMomentum
from .plan import ShardPlan, SlicePlan, assigned_rows
from .replica.steppers import check_scalable, local_mask
from .replies import check_reply, check_states
from .run import TrainingRun, weighted_logs


def train_sync(run: TrainingRun) -> History:
    """The synchronous loop: one round = broadcast weights, every live worker trains its rows, average."""
    app, cfg, history, cluster = run.app, run.cfg, run.history, run.cluster
    if cfg.scale_learning_rate:
        check_scalable(app.model)  # here, before any round: the workers' models are the master's architecture
    weights = [np.require(w, requirements="C") for w in app.model.get_weights()]  # 0-d stays 0-d
    opt_state: list[np.ndarray] | None = run.resumed.get("optimizer_state") if run.resumed else None
    round_no = len({(s.epoch, s.round) for s in history.stats})
    ring = RingExchange(run, weights) if cfg.ring is not None else None
    if ring is not None:
        run.members.note("exchange", exchange="allreduce")
    # The outer optimizer: applied here to the merged weights; with the ring each worker applies it (worker.py).
    spec = cfg.outer()
    outer = OuterMomentum(spec) if spec is not None and ring is None else None
    trained = [not m for m in local_mask(app.model)]
    if outer is not None and run.resumed:
        outer.load(run.resumed.get("outer_state"))

    def stop_if_preempted(epoch: int, merged_at: int) -> None:
        """Preempted: checkpoint the last merged round (with the ring the workers hold its weights: fetched while
        they still answer, else the epoch's checkpoint stands) and stop."""
        run.stop_if_preempted(
            epoch,
            merged_at,
            ring.current_weights if ring is not None else weights,
            opt_state,
            "sync",
            outer.state() if outer is not None else None,
        )

    def take_edits() -> None:
        """A callback set the master's weights (:meth:`.run.TrainingRun.edited_weights`): the next round starts
        from them."""
        nonlocal weights
        edited = run.edited_weights(weights)
        if edited is not None:
            weights = edited
            if ring is not None:
                ring.restart_from(weights)

    for epoch in range(run.initial_epoch, cfg.epochs):
        t_epoch = run.begin_epoch(epoch)
        take_edits()
        plan = ShardPlan(run.shard_rows, cfg, epoch) if app.sharded else SlicePlan(run.rows, len(cluster), cfg, epoch)
        if epoch == run.initial_epoch and run.resume_position:
            plan.seek(run.resume_position)  # a preempted run goes on at the round after its last merged one
        merged_at = plan.position()
        epoch_results: list[WorkerResult] = []
        done = 0
        while not plan.finished():
            # Preempted: checkpoint the last merged round (with the ring the workers hold the weights: fetched if
            # they still answer, else the epoch's checkpoint stands) and stop.
            if run.preempted():  # checked first: the outer optimizer's state is copied only when it is needed
                stop_if_preempted(epoch, merged_at)
            run.members.round = round_no
            live = run.members.live() or run.members.wait_for_any(cfg.run.rejoin_timeout)
            progress = plan.progress()
            assignments = plan.next_round(live)
            if not assignments:
                continue
            run.round_begin(round_no)
            t0 = time.perf_counter()
            if ring is not None:
                factors = None
                if cfg.scale_learning_rate:  # at the round's first and last step
                    n = len(assignments)
                    first = epoch + progress
                    last = max(first, epoch + plan.progress() - cfg.batch_size * n / max(1, run.rows))
                    factors = (cfg.learning_rate_factor(n, first), cfg.learning_rate_factor(n, last))
                results, t_sent, send_s, call_s = ring.run_round(assignments, epoch, round_no, t0, factors)
            else:
                results, t_sent, send_s, call_s = _round(run, weights, opt_state, assignments, epoch, round_no, t0)
            wall = time.perf_counter() - t0
            live = run.members.live()  # copies the loss events into History now, with this round's number
            live_results = [r for r in results if r.samples > 0]
            if not live_results and run.preempted():
                # The round was abandoned (the scheduler stops the workers too): stop before it could count as
                # trained, even as the epoch's last.
                stop_if_preempted(epoch, merged_at)
            if not results and not live:
                # Every worker of the round was lost: as before any round, one must come back within the
                # rejoin timeout (else WorkerUnavailable), even after the run's last round, which must not end
                # as trained on no worker at all.
                run.members.wait_for_any(cfg.run.rejoin_timeout)
            # With the ring the workers averaged among themselves; the master fetches the weights at epoch end.
            if ring is None and live_results:
                samples = [float(r.samples) for r in live_results]
                payloads = [r.payload for r in live_results]
                merged = ops.weighted_average(payloads, samples)
                start = [w.copy() for w in weights] if outer is not None else weights
                if cfg.compression is not None:  # workers sent deltas (a counter's: the sum of them)
                    ops.add_counter_changes(merged, [np.zeros_like(w) for w in weights], payloads)
                    ops.axpy_(weights, merged)
                else:
                    ops.add_counter_changes(merged, weights, payloads)  # counters: every worker's steps
                    weights = merged
                if outer is not None:
                    weights = outer.step(start, weights, trained)
                if cfg.average_optimizer_state:
                    opt_state = average_states([r.optimizer_state or [] for r in live_results], samples)
            sent = 0 if ring is not None else nbytes(weights) + (nbytes(opt_state) if opt_state else 0)
            for r in results:
                comm = call_s.get(r.worker, (0.0, 0.0))[1]
                history.stats.append(
                    RoundStats(
                        epoch=epoch,
                        round=round_no,
                        worker=r.worker,
                        samples=r.samples,
                        compute_seconds=r.compute_seconds,
                        wait_seconds=max(0.0, wall - (t_sent - t0) - comm),
                        data_wait_seconds=r.data_wait_seconds,
                        bytes_sent=sent,
                        bytes_received=nbytes(r.weights) + nbytes(r.optimizer_state),
                        start=t0 - run.state.t0,
                        send_seconds=send_s.get(r.worker, (0.0, t_sent - t0))[1],
                        comm_seconds=max(0.0, comm - r.compute_seconds),
                        optimizer_state_bytes=r.optimizer_state_bytes,
                        resident_bytes=r.resident_bytes,
                    )
                )
            if live_results:
                merged_at = plan.position()
            epoch_results += results
            done += sum(r.samples for r in results)
            round_logs: dict[str, Any] = weighted_logs(live_results) if live_results else {}
            round_logs["samples_done"] = done
            run.round_end(round_no, round_logs)
            round_no += 1
            if app.stop_training:
                # a callback set stop_training (TerminateOnNaN, a user's on_train_batch_end): as fit ends its
                # epoch at the batch it was set on, this one ends at the round's end, with the logs of what trained
                break
        if ring is not None:
            weights = ring.weights()
        stop = run.end_epoch(weights, epoch_results, epoch, t_epoch)
        take_edits()
        run.save_checkpoint(epoch + 1, weights, opt_state, "sync", outer.state() if outer is not None else None)
        if stop:
            break
    return history


def _round(
    run: TrainingRun,
    weights: list[np.ndarray],
    opt_state: list[np.ndarray] | None,
    assignments: list[tuple[int, Rows]],
    epoch: int,
    round_no: int,
    t0: float,
) -> tuple[list[WorkerResult], float, dict[int, tuple[float, float]], dict[int, tuple[float, float]]]:
    """Send the weights to the round's workers and have each train its rows. Returns the results of the
    workers that answered, when sending ended, and the send and train calls' per-worker timings."""
    cfg, cluster = run.cfg, run.cluster
    targets = [w for w, _ in assignments]
    sent_ok = cluster.set(weights_var(run.state.run_id), weights, workers=targets, return_exceptions=True)
    send_s = cluster.last_call_timings()
    t_sent = time.perf_counter()
    args, running = [], []
    learning_rate = run.learning_rate()
    optimizer_groups = run.optimizer_groups()
    for (w, rows), ok in zip(assignments, sent_ok):
        if isinstance(ok, BaseException):
            run.fail(ok)
            run.lost(epoch, round_no, w, 0.0, t0)
            continue
        spec = MasterRound(
            run_id=run.state.run_id,
            rows=rows,
            batch_size=cfg.batch_size,
            prefetch=cfg.data.prefetch,
            compression=cfg.compression,
            slow_seconds_per_batch=run.state.slow_seconds(w),
            return_delta=cfg.compression is not None,
            return_optimizer_state=cfg.average_optimizer_state,
            optimizer_state=opt_state,
            topk_ratio=cfg.topk_ratio,
            learning_rate=learning_rate,
            optimizer_groups=optimizer_groups,
        )
        args.append((spec,))
        running.append(w)
    outcomes = cluster.run_each(remote.train_chunk, args, workers=running, return_exceptions=True) if running else []
    call_s = cluster.last_call_timings()
    wall = time.perf_counter() - t0
    row_counts = {w: assigned_rows(part) for w, part in assignments}
    results: list[WorkerResult] = []
    for w, out in zip(running, outcomes):
        if isinstance(out, BaseException):
            run.fail(out)
            run.lost(epoch, round_no, w, wall, t0)
            continue
        try:
            result = check_reply(w, out, weights, rows=row_counts[w], compression=cfg.compression)
        except BadWorkerReply as exc:
            run.refuse(exc)
            continue
        results.append(result)
    if cfg.average_optimizer_state:
        for r, reason in check_states(results):
            run.refuse(BadWorkerReply(reason, worker_id=r.worker))
            results.remove(r)
    return results, t_sent, send_s, call_s
