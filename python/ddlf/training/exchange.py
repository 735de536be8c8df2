"""How a synchronous round's workers agree on the averaged weights: :class:`~ddlf.ThroughMaster` or
:class:`~ddlf.Ring` (``ModelAveraging(exchange=...)``; gradient averaging always uses the ring).

:class:`~ddlf.ThroughMaster` (:mod:`.synchronous`'s own round): the master broadcasts the weights, every worker
returns its own, the master averages them. Every byte of every round crosses the master's link: ``2 n W`` per round
for ``n`` workers and ``W`` bytes of weights, so rounds slow down as workers are added.

:class:`~ddlf.Ring` (:class:`RingExchange`): the workers average among themselves over a ring
(:mod:`ddlf.worker.reduction`); each sends and receives ``2 (n-1)/n W`` per round whatever ``n``, and the master
only plans rows and gathers metrics. It sends weights only to a worker that has none for the run yet (the first
round, or a worker that joined or came back), taken from a member that holds the current ones, and fetches them
when it needs them (epoch end, validation, checkpoints).

Faults: a worker killed or cut off during a round fails the ring's all-reduce everywhere (its neighbours see the
link close at once, or stop answering within the cluster's ``heartbeat_timeout``); the master leaves out the lost
worker, forms a new ring from the survivors and **redoes the round** from the weights they all held before it
(each worker keeps them until the next round), over the survivors' rows of the round. The lost worker rejoins at a
later round with the current weights.

:class:`~ddlf.AutoExchange`: the ring when the run's workers are on more than one host (so the master's link is the
bottleneck it removes), the master exchange when they share one host (where the master exchange writes the weights
once to shared memory for all of them). On a cluster that uses TLS the ring's peer links use it too
(:meth:`ddlf.Cluster.ring`).

Half-precision compression on the ring: float32 values travel at half precision on every link, sums stay float32
(:func:`ddlf.collective.reduce_arrays`). Model averaging then reduces each round's *change* of the weights (small
values, as the master exchange's compressed replies), gradient averaging the gradients; either way every member
applies the same bits. :class:`~ddlf.TopK` exists only through the master: the ring sums dense arrays.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

import numpy as np

from ..cluster.rings import host_of
from ..errors import BadWorkerReply, CollectiveError, NonFiniteUpdate, NotFoundError, RemoteError, WorkerUnavailable
from . import replica as remote
from .messages import GradientRound, RingRound, Rows, WorkerResult, weights_var
from .options import AutoExchange, Ring, ThroughMaster
from .plan import assigned_rows
from .policy import stopping as stopping_worker
from .replies import check_reply
from .run import TrainingRun

MAX_REDOS = 8
"""Rounds redone in a row (each after a failed all-reduce) before training gives up."""


def resolve(exchange: ThroughMaster | Ring | AutoExchange, cluster: Any, workers: list[int]) -> ThroughMaster | Ring:
    """The exchange model averaging uses on ``workers`` of ``cluster``: :class:`~ddlf.AutoExchange` decided by
    the rule in the module docs (by the hosts the workers are on), the others as they are."""
    if isinstance(exchange, AutoExchange):
        return exchange.resolve(len({host_of(cluster.addresses[w]) for w in workers}))
    return exchange


def is_collective_failure(exc: BaseException) -> bool:
    """A worker's all-reduce failed (a neighbour was lost): the worker itself is fine."""
    return isinstance(exc, RemoteError) and exc.raised("CollectiveError")


class RingExchange:
    """The master's side of the ring exchange (:class:`~ddlf.Ring`) for one run."""

    def __init__(self, run: TrainingRun, weights: list[np.ndarray]) -> None:
        self.run = run
        self.synced: dict[int, int] = {}
        """Workers holding the current weights: worker -> daemon instance."""
        self.round: int | None = None
        """The last round reduced."""
        self.fallback = weights
        """The newest weights the master holds (the start, or the last fetched)..."""
        self.fallback_round: int | None = None
        """...and the round they are of (None: the start)."""
        self.sharded_ring: tuple[tuple[int, int], ...] | None = None
        """With sharded optimizer state: the members (worker, daemon instance) of the last round, whose shards
        the workers hold..."""
        self.shards_held = run.optimizer_adopted or bool(
            run.resumed and any((s or {}).get("optimizer_shard") for s in run.resumed.get("worker_states", {}).values())
        )
        """...and whether any worker holds optimizer state (after a round, restored from a checkpoint, or the
        master's: :func:`.master_optimizer.push`)."""

    # -- what the loop asks ---------------------------------------------------------------------------------

    def weights(self) -> list[np.ndarray]:
        """The current weights: fetched from a worker that holds them (the master's own newest copy when none
        does any more)."""
        cluster, run_id = self.run.cluster, self.run.state.run_id
        for w in list(self.synced) if self.round is not None else []:
            try:
                got = cluster.run_on(w, remote.reduced_weights, run_id, self.round)
            except (WorkerUnavailable, RemoteError):  # gone, or it no longer holds that round
                self.synced.pop(w, None)
                continue
            self.fallback = [np.asarray(a) for a in got]
            self.fallback_round = self.round
            break
        return self.fallback

    def current_weights(self) -> list[np.ndarray]:
        """:meth:`weights`, or :class:`~ddlf.errors.NotFoundError` when no worker holding the last round's weights
        answers and the master's own copy is older (a checkpoint must not pair them with a later position)."""
        got = self.weights()
        if self.fallback_round != self.round:
            raise NotFoundError(
                f"no worker holding round {self.round}'s weights answers (the master has round "
                f"{self.fallback_round if self.fallback_round is not None else 'none'}'s)"
            )
        return got

    def restart_from(self, weights: list[np.ndarray]) -> None:
        """The master's model was given ``weights`` (a callback set them): the workers holding the last round's
        take them as its result, and start the next round from them (still members: their optimizer state, or
        shard, goes on, and a redo rewinds as ever); one that does not answer is sent them as a new member, as is
        any other."""
        self.fallback, self.fallback_round = weights, self.round
        holders = list(self.synced)
        if self.round is None or not holders:
            self.synced = {}
            return
        cluster, run_id = self.run.cluster, self.run.state.run_id
        done = cluster.call(
            remote.replace_reduced_weights, (run_id, self.round, weights), workers=holders, return_exceptions=True
        )
        for w, ok in zip(holders, done):
            if isinstance(ok, BaseException):
                self.synced.pop(w, None)

    def forget(self, worker: int) -> None:
        """``worker`` was lost: it no longer holds the current weights."""
        self.synced.pop(worker, None)

    def run_round(
        self,
        assignments: list[tuple[int, Rows]],
        epoch: int,
        round_no: int,
        t0: float,
        learning_rate_factor: tuple[float, float] | None = None,
    ) -> tuple[list[WorkerResult], float, dict[int, tuple[float, float]], dict[int, tuple[float, float]]]:
        """Train and all-reduce one round (redone without lost workers until it succeeds). Returns the results,
        when sending ended, and the send and train calls' per-worker timings (as the master round does).
        ``learning_rate_factor``: with gradient averaging, the learning rate's multiples at the round's first
        and last step."""
        run, cfg, cluster = self.run, self.run.cfg, self.run.cluster
        start: list[np.ndarray] | None = None
        pending = list(assignments)
        send_s: dict[int, tuple[float, float]] = {}
        t_sent = time.perf_counter()
        for attempt in range(MAX_REDOS):
            if not pending:
                return [], t_sent, send_s, {}
            targets = [w for w, _ in pending]
            ring = cluster.ring(targets, hierarchical=cfg.ring.hierarchical if cfg.ring is not None else None)
            fresh = [w for w in targets if self.synced.get(w) != cluster.instance(w)]
            lost: list[int] = []
            if fresh:
                if start is None:
                    start = self.weights()
                sent = cluster.set(weights_var(run.state.run_id), start, workers=fresh, return_exceptions=True)
                send_s = cluster.last_call_timings()
                for w, ok in zip(fresh, sent):
                    if isinstance(ok, BaseException):
                        run.fail(ok)
                        lost.append(w)
            t_sent = time.perf_counter()
            if lost:
                pending = self._drop(pending, lost, epoch, round_no, t0)
                continue
            args = []
            gradients = cfg.averaging == "gradients"
            if gradients:
                # Every member takes as many steps as the one with the most batches (lockstep), and new members
                # adopt the others' optimizer state first.
                steps = max(-(-assigned_rows(part) // cfg.batch_size) for _, part in pending)
                adopt = bool(fresh) and len(fresh) < len(targets)
                shard = self._shard_plan(targets, attempt) if cfg.gradients and cfg.gradients.shard_optimizer else None
            outer = cfg.outer()
            new_rate = run.learning_rate()
            new_groups = run.optimizer_groups()
            for w, rows in pending:
                common: dict[str, Any] = {
                    "run_id": run.state.run_id,
                    "rows": rows,
                    "batch_size": cfg.batch_size,
                    "prefetch": cfg.data.prefetch,
                    "compression": cfg.compression,
                    "slow_seconds_per_batch": (run.state.slow_seconds(w)),
                    "round_no": round_no,
                    "ring": ring.spec(w),
                    "fresh": w in fresh,
                    "learning_rate": new_rate,
                    "optimizer_groups": new_groups,
                }
                spec: GradientRound | RingRound
                if gradients:
                    spec = GradientRound(
                        **common,
                        steps=steps,
                        adopt=adopt,
                        bucket_cap_mb=cfg.gradients.bucket_cap_mb if cfg.gradients else None,
                        learning_rate_factor=learning_rate_factor if cfg.scale_learning_rate else None,
                        shard=shard,
                    )
                else:
                    # New members adopt the outer momentum of the others (when all are new: of those that hold
                    # one, restored from a checkpoint; zeros when none does).
                    spec = RingRound(
                        **common,
                        average_optimizer_state=cfg.average_optimizer_state,
                        round_rows=sum(assigned_rows(part) for _, part in pending) if cfg.compression else 1,
                        outer=(outer.name, outer.learning_rate, outer.momentum) if outer is not None else None,
                        adopt_outer=(
                            None if outer is None or not fresh else ("any" if len(fresh) == len(targets) else "others")
                        ),
                    )
                args.append((spec,))
            step_fn = remote.train_gradients if gradients else remote.train_reduce
            outcomes = cluster.run_each(step_fn, args, workers=targets, return_exceptions=True)
            call_s = cluster.last_call_timings()
            failed_ring = False
            stopping: list[int] = []
            for w, out in zip(targets, outcomes):
                if not isinstance(out, BaseException):
                    continue
                if is_collective_failure(out):
                    failed_ring = True
                else:
                    run.fail(out)  # raises unless the policy carries on without this worker
                    lost.append(w)
                    if stopping_worker(out):  # it still holds the last round reduced: ddlf.worker.drain
                        stopping.append(w)
            if not lost and not failed_ring:
                self.synced = {w: cluster.instance(w) for w in targets}
                self.round = round_no
                if gradients and cfg.gradients is not None and cfg.gradients.shard_optimizer:
                    self.sharded_ring = tuple((w, cluster.instance(w)) for w in targets)
                    self.shards_held = True
                    lost_state = max((int(o.get("optimizer_elements_lost") or 0) for o in outcomes), default=0)
                    if lost_state and shard not in ("fresh", None):
                        run.optimizer_state_lost(lost_state)
                row_counts = {w: assigned_rows(part) for w, part in pending}
                results = []
                for w, out in zip(targets, outcomes):
                    try:  # its weights are in the ring's average already; its samples and logs are checked here
                        results.append(
                            check_reply(w, out, [], rows=row_counts[w], compression=None, weights_expected=False)
                        )
                    except BadWorkerReply as exc:
                        run.refuse(exc)
                    if not isinstance(out, dict):
                        continue
                    if out.get("nonfinite_batches", 0):
                        run.nonfinite_gradients(w, int(out["nonfinite_batches"]))
                    if out.get("nonfinite_weights"):
                        run.refuse(
                            NonFiniteUpdate(
                                f"worker {w}'s weights are not finite (NaN or infinity) after "
                                "the round: left out of the ring's average",
                                worker_id=w,
                            )
                        )
                overflow = max(
                    (int(o.get("wire_overflow_steps") or 0) for o in outcomes if isinstance(o, dict)),
                    default=0,
                )
                if overflow:
                    run.wire_overflow(overflow)
                return results, t_sent, send_s, call_s
            survivors = [w for w in targets if w not in lost]
            cluster.retire_ring(ring)  # spent: the next attempt forms a new one
            pending = self._drop(pending, lost, epoch, round_no, t0, keep=stopping)
            if run.preempted():
                # The scheduler stops the workers too: the round is abandoned, the last one merged stands (the
                # workers still answer for it while they drain: ddlf.worker.drain).
                run.members.note("round_abandoned", lost=lost, survivors=survivors)
                return [], t_sent, send_s, {}
            run.members.note("allreduce_redo", lost=lost, survivors=survivors)
        hint = ""
        if cfg.averaging == "gradients" and run.state.strategy_reason is not None:
            hint = (
                f" (ddlf's default strategy, {run.state.strategy_reason}, reduces worker to worker: where the workers "
                "cannot reach each other's ring ports, pass strategy=ddlf.ModelAveraging() to average through "
                "the master)"
            )
        raise CollectiveError(f"round {round_no}: the all-reduce failed {MAX_REDOS} times in a row{hint}")

    def _shard_plan(self, targets: list[int], attempt: int) -> str:
        """What the workers do with their optimizer shards this round (``ShardedOptimizer.begin``)."""
        if attempt > 0:
            return "redo"
        members = tuple((w, self.run.cluster.instance(w)) for w in targets)
        if members == self.sharded_ring:
            return "keep"
        return "reshard" if self.shards_held else "fresh"

    def _drop(
        self,
        pending: list[tuple[int, Rows]],
        lost: list[int],
        epoch: int,
        round_no: int,
        t0: float,
        keep: Collection[int] = (),
    ) -> list[tuple[int, Rows]]:
        """Leave ``lost`` out of the round. Those in ``keep`` (stopping: :func:`.policy.stopping`) still hold the
        last round's weights, and :meth:`weights` may still read them."""
        wall = time.perf_counter() - t0
        for w in lost:
            if w not in keep:
                self.forget(w)
            self.run.lost(epoch, round_no, w, wall, t0)
        return [(w, e) for w, e in pending if w not in lost]
