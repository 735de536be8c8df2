"""One training run: what the synchronous and asynchronous loops share.

A :class:`TrainingRun` holds the app, its config (with its :class:`~.policy.FailurePolicy`), History, callbacks,
membership (:class:`~.membership.Members`) and the dataset's size; it opens and closes epochs, records rounds and
lost workers, and writes checkpoints. A loop only decides what a round is. :class:`WorkerResult` is what a
worker's training chunk returns, typed.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import (
    BadWorkerReply,
    ConfigError,
    ModelChangeWarning,
    ModelMismatchError,
    NonFiniteGradientsWarning,
    NonFiniteUpdate,
    Preempted,
    RemoteError,
    ReplyRefusedWarning,
    WireOverflowWarning,
    WorkerLostWarning,
    WorkerUnavailable,
)
from ..frameworks import model_spec, torch_spec
from . import checkpoint, master_optimizer
from . import replica as remote
from .callbacks import ProgressBar
from .history import History, RoundStats
from .keras_callbacks import KerasCallback, learning_rate
from .membership import Members
from .messages import WorkerResult
from .options import TrainConfig
from .policy import FailurePolicy, stopping
from .preemption import Preemption
from .remote_evaluation import contiguous_parts, evaluate_on_workers
from .replica.sharded import join as join_shards


def weighted_logs(results: list[WorkerResult]) -> dict[str, float]:
    """Average the workers' Keras logs, weighted by samples."""
    total = sum(r.samples for r in results) or 1
    keys = set().union(*(r.logs.keys() for r in results)) if results else set()
    return {k: sum(r.logs.get(k, 0.0) * r.samples for r in results) / total for k in sorted(keys)}


SLOW_WORKER_ENV = "DDLF_SLOW_WORKER"
"""``WORKER:SECONDS``: that worker sleeps this long per batch, in every run this master starts (for experiments
with stragglers: the slow-worker benchmark and tests)."""


def _slow_worker() -> tuple[int, float] | None:
    text = os.environ.get(SLOW_WORKER_ENV)
    if not text:
        return None
    try:
        worker, seconds = text.split(":")
        return int(worker), float(seconds)
    except ValueError:
        raise ConfigError(f"{SLOW_WORKER_ENV}={text!r}: expected WORKER:SECONDS, e.g. 1:0.02") from None


@dataclass
class RunState:
    """What one ``app.train`` call is beyond what it asked for (:class:`~.options.TrainConfig`, which an override
    of ``train_sync``/``train_async`` receives): its id, its clock, the straggler hook of experiments, why ddlf
    chose its strategy, and the checkpoint it resumes. Kept by the run, never by the user's options."""

    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """What the workers' status and logs call this run."""
    t0: float = field(default_factory=time.perf_counter)
    """Training start: round start times are relative to it."""
    slow_worker: tuple[int, float] | None = field(default_factory=_slow_worker)
    """``(worker, seconds per batch)`` from :data:`SLOW_WORKER_ENV`, for experiments."""
    strategy_reason: str | None = None
    """Why the strategy is the one :func:`ddlf.training.defaults.default_strategy` chose (None: the user's)."""
    resumed: dict[str, Any] | None = field(default=None, repr=False)
    """The checkpoint this run resumes, when ``train`` read it already (to choose the default strategy)."""

    def slow_seconds(self, worker: int) -> float:
        """Seconds ``worker`` sleeps after each batch (the experiments' straggler; 0: none)."""
        slow = self.slow_worker
        return slow[1] if slow is not None and slow[0] == worker else 0.0


@dataclass
class TrainingRun:
    """One ``app.train`` call, as both loops see it."""

    app: Any
    cfg: TrainConfig
    state: RunState
    history: History
    callbacks: list[Any]
    members: Members
    rows: int
    """Rows per epoch (a sharded dataset: all shards together)."""
    shard_rows: list[int]
    """Rows of each shard (one entry per set-up worker when not sharded)."""
    initial_epoch: int = 0
    validation_data: Any = None
    resumed: dict[str, Any] | None = None
    start_learning_rate: float | None = None
    """The master's learning rate when training began (None: not a plain Keras rate)."""
    learning_rate_changed: bool = False
    start_optimizer_groups: list[dict[str, Any]] | None = None
    """A ``TorchModel``'s optimizer hyperparameters when training began (None: not a TorchModel)."""
    optimizer_groups_changed: bool = False
    start_signature: dict[str, Any] | None = None
    """What of the master's model the workers took at setup only (:func:`~ddlf.frameworks.model_spec.signature`):
    a change during the run is warned of once."""
    preemption: Preemption | None = None
    """The signals that end this run at a round boundary (:mod:`.preemption`; None: none caught)."""
    resume_position: int = 0
    """Where in ``initial_epoch`` a preempted run resumes (its plan's :meth:`seek`)."""
    optimizer_adopted: bool = False
    """Whether the workers started from the master's optimizer state (:func:`.master_optimizer.push`)."""
    optimizer_pulled: bool = False
    """Whether the master's optimizer holds the workers' state as of now (:func:`.master_optimizer.pull`)."""
    watch_weights: bool = False
    """Whether the user's callbacks may set the master's weights during the run (:meth:`edited_weights`)."""

    def __post_init__(self) -> None:
        self.start_learning_rate = learning_rate(self.app.model)
        self.start_optimizer_groups = torch_spec.optimizer_groups(self.app.model)
        self.start_signature = model_spec.signature(self.app.model)
        self.watch_weights = any(not isinstance(cb, ProgressBar) for cb in self.callbacks)

    @property
    def cluster(self) -> Any:
        return self.app.cluster

    @property
    def policy(self) -> FailurePolicy:
        """What a worker's failure does to this run (``cfg.run.failure_policy``)."""
        return self.cfg.run.failure_policy

    def refuse(self, exc: BadWorkerReply) -> None:
        """A worker's reply was refused (:mod:`.replies`): leave it out, warn and record it, or stop the run when
        it held non-finite values and the run says ``RunConfig(nonfinite="raise")``."""
        if isinstance(exc, NonFiniteUpdate) and self.cfg.run.nonfinite == "raise":
            raise exc
        warnings.warn(f"{exc}; its reply is left out of this round", ReplyRefusedWarning, stacklevel=2)
        self.members.note("reply_refused", worker=exc.worker_id, reason=str(exc), error=type(exc).__name__)

    def nonfinite_gradients(self, worker: int, batches: int) -> None:
        """With gradient averaging, worker ``worker`` left ``batches`` batches out of their steps because
        their gradients were not finite (averaged in, they would have reached every replica): warn and record it,
        or stop the run when it says ``RunConfig(nonfinite="raise")``."""
        what = f"worker {worker} computed non-finite gradients (NaN or infinity) on {batches} batch(es)"
        if self.cfg.run.nonfinite == "raise":
            raise NonFiniteUpdate(f"{what}: its model diverged, or its data holds NaN", worker_id=worker)
        warnings.warn(f"{what}; they were left out of their steps", NonFiniteGradientsWarning, stacklevel=2)
        self.members.note("nonfinite_gradients", worker=worker, batches=batches)

    def optimizer_state_lost(self, elements: int) -> None:
        """With sharded optimizer state, the ring changed and ``elements`` weights' optimizer state was held by no
        worker of the new one (a lost worker's shard): it restarts from zeros. Warn and record it."""
        self._warn(
            f"the optimizer state of {elements} weights went with a lost worker (shard_optimizer=True keeps one "
            "copy): it restarts from zeros",
            WorkerLostWarning,
            "optimizer_state_lost",
            elements=elements,
        )

    def wire_overflow(self, steps: int) -> None:
        """The ring's average of ``steps`` steps (or a round) overflowed float16 on the wire (the same on every
        worker): those updates were skipped. Warn and record it."""
        self._warn(
            f"{steps} update(s) overflowed float16 compression on the ring and were skipped on every worker; "
            'Ring(compression="bfloat16") has float32\'s range',
            WireOverflowWarning,
            "wire_overflow",
            updates=steps,
        )

    def _warn(self, message: str, category: type[Warning], event: str, **fields: Any) -> None:
        """Warn the user (from the caller's caller) and record ``event`` with ``fields`` in History."""
        warnings.warn(message, category, stacklevel=3)
        self.members.note(event, **fields)

    def fail(self, exc: BaseException) -> None:
        """A worker failed: raise unless the policy says to carry on without it, or the run is preempted (the
        scheduler stopped its workers too: the round is abandoned and the checkpoint written)."""
        if stopping(exc):
            self.members.stopped(exc)  # no further round for it: it refuses them while it drains
        if self.preempted():
            return
        if _going_away(exc) and self.preemption is not None and self.preemption.settle():
            return  # the scheduler is stopping the job: its signal came to this process too (preemption.py)
        if self.policy.decide(exc) == "raise":
            raise exc

    def begin_epoch(self, epoch: int) -> float:
        """Open an epoch; returns its start time."""
        self.members.epoch = epoch
        self.optimizer_pulled = False
        for cb in self.callbacks:
            cb.on_epoch_begin(epoch)
        return time.perf_counter()

    def learning_rate(self) -> float | None:
        """The master's learning rate once a callback has changed it (ReduceLROnPlateau, ...), for the next
        rounds to carry to the workers; None until then (each worker keeps the rate it was compiled with)."""
        if self.start_learning_rate is None:
            return None
        now = learning_rate(self.app.model)
        if now is not None and (self.learning_rate_changed or now != self.start_learning_rate):
            self.learning_rate_changed = True
            return now
        return None

    def check_model_changes(self, epoch: int) -> None:
        """Warn (once a run) when a callback changed what the workers take at setup only: a recompile, a
        ``trainable`` flag or ``run_eagerly`` (Keras), ``requires_grad`` or the optimizer
        (torch). The workers take it when the next ``train()`` sets up; a learning rate (Keras) and torch's
        optimizer groups travel with every round and need no warning."""
        if self.start_signature is None:
            return
        parts = model_spec.changed(self.start_signature, model_spec.signature(self.app.model))
        if not parts:
            return
        self.start_signature = None
        what = ", ".join(parts)
        message = (
            f"the master's model changed during train() (its {what}, in epoch {epoch}): the workers took the model "
            "as it was when training started and keep it until this train() ends; the next train() takes the change"
        )
        warnings.warn(message, ModelChangeWarning, stacklevel=2)
        self.members.note("model_changed", parts=parts)

    def optimizer_groups(self) -> tuple[dict[str, Any], ...] | None:
        """A ``TorchModel`` optimizer's hyperparameters on the master once they changed during the run (a torch
        scheduler stepped by a callback, ``group["lr"] = ...``), for the next rounds to carry to the workers; None
        until then (the workers hold what the master's optimizer held when the run set up)."""
        if self.start_optimizer_groups is None:
            return None
        now = torch_spec.optimizer_groups(self.app.model)
        if now is not None and (self.optimizer_groups_changed or now != self.start_optimizer_groups):
            self.optimizer_groups_changed = True
            return tuple(now)
        return None

    def round_begin(self, round_no: int) -> None:
        for cb in self.callbacks:
            cb.on_round_begin(round_no, {})

    def round_end(self, round_no: int, logs: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb.on_round_end(round_no, logs)

    def lost(self, epoch: int, round_no: int, worker: int, wall: float, t0: float) -> None:
        """Record a worker lost during a round."""
        stats = RoundStats(epoch, round_no, worker, 0, 0.0, wall, 0.0, 0, 0, lost=True, start=t0 - self.state.t0)
        self.history.stats.append(stats)

    def end_epoch(self, weights: list[np.ndarray], results: list[WorkerResult], epoch: int, t_epoch: float) -> bool:
        """Close an epoch: the master's model takes the weights, the workers' logs are averaged, validation runs,
        History and callbacks hear of it. Returns whether training should stop."""
        app = self.app
        app.model.set_weights(weights)
        logs = weighted_logs([r for r in results if r.samples > 0])
        if self.cfg.validates(epoch):
            logs.update(self.validation_logs(weights))
        self.history.record_epoch(logs, time.perf_counter() - t_epoch, epoch)
        recorded = list(logs)
        if any(isinstance(cb, KerasCallback) for cb in self.callbacks):
            # Keras' callbacks see the model as fit shows it, its optimizer too (BackupAndRestore and
            # ModelCheckpoint save it with the weights)
            self.optimizer_pulled = master_optimizer.pull(self)
            self.decide_monitors()
        for cb in self.callbacks:
            cb.on_epoch_end(epoch, logs)  # one dict for all, as in fit: what a callback adds, the next ones see
        self.history.record_added(logs, recorded)  # History is fit's last callback
        self.check_model_changes(epoch)
        app.epochs_done = epoch + 1
        return bool(app.stop_training)

    def edited_weights(self, weights: list[np.ndarray]) -> list[np.ndarray] | None:
        """The master's model's weights where a callback set them (``on_epoch_begin``, ``on_epoch_end``: a reset,
        an average swapped in, ``set_weights``), against ``weights``, what the run gave the model last; None where
        they are unchanged (or no callback of the user's runs). As in ``fit``, where callbacks change the model
        that trains, the workers train on from them: the loops send them with the next round."""
        if not self.watch_weights:
            return None
        now = self.app.model.get_weights()
        if len(now) == len(weights) and all(_same(a, b) for a, b in zip(now, weights)):
            return None
        shapes = [np.shape(w) for w in weights]
        if [np.shape(w) for w in now] != shapes:
            raise ModelMismatchError(
                f"a callback changed the master's model's weights to {len(now)} arrays of other shapes than the "
                f"{len(weights)} the workers train ({shapes[:4]}...): a run trains create_model()'s architecture"
            )
        self.members.note("weights_set", epoch=self.members.epoch)
        return [np.require(w, requirements="C") for w in now]

    def decide_monitors(self) -> None:
        """Keras callbacks that watch a metric with ``mode="auto"`` learn from a worker whether it is better higher
        or lower (the master's model never built its metrics: :meth:`KerasCallback.undecided_metric`)."""
        undecided = [cb for cb in self.callbacks if isinstance(cb, KerasCallback) and cb.undecided_metric()]
        live = self.members.live() if undecided else []
        if not live:
            return
        (directions,) = self.cluster.call(
            remote.metric_directions, (self.state.run_id,), workers=live[:1], return_exceptions=True
        )
        if isinstance(directions, BaseException):
            return  # (a worker lost just now) Keras decides, or says to pass mode
        for cb in undecided:
            cb.decide(directions)

    def validation_logs(self, weights: list[np.ndarray]) -> dict[str, float]:
        """``val_*`` logs of the epoch's weights: on ``validation_data`` (the master's model), or on the rows
        ``validation_split`` held out, evaluated where they are (the workers; a lost worker's part is left out,
        and History records it)."""
        if self.validation_data is not None:
            return self.app.validate(self.validation_data)
        if not self.cfg.fit.validation_split:
            return {}
        live = self.members.live()
        if self.app.sharded:
            parts: list[tuple[int, int] | None] = [None] * len(live)  # each its own shard's held-out rows
        else:
            held_out = max(int(self.members.info[self.cluster.addresses[w]]["validation_rows"]) for w in live)
            parts = list(contiguous_parts(self.rows, self.rows + held_out, len(live), self.cfg.batch_size))
        try:
            logs = evaluate_on_workers(self.cluster, self.state.run_id, live, weights, parts, self.cfg.batch_size)
        except (WorkerUnavailable, RemoteError) as exc:
            if not _going_away(exc):
                raise
            self.fail(exc)
            self.members.note("validation_skipped", reason=str(exc))
            return {}
        return {f"val_{k}": float(v) for k, v in logs.items()}

    def preempted(self) -> bool:
        """Whether a preemption signal arrived (:mod:`.preemption`)."""
        return self.preemption is not None and self.preemption.requested is not None

    def stop_if_preempted(
        self,
        epochs_done: int,
        position: int,
        weights: list[np.ndarray] | Callable[[], list[np.ndarray]],
        opt_state: list[np.ndarray] | None,
        mode: str,
        outer_state: list[np.ndarray] | None = None,
    ) -> None:
        """After a preemption signal: write the checkpoint of ``epochs_done`` epochs and ``position`` into the
        next, requeue the Slurm job where the signal asks for it, and raise :class:`~ddlf.errors.Preempted`.
        ``weights`` may be a callable (the ring's, fetched from the workers): if it fails, the last checkpoint
        written stands."""
        p = self.preemption
        if p is None or p.requested is None:
            return
        path: str | None = None
        why = ""
        # Noted first, so the checkpoint's History says how the run ended (the resumed run shows it too).
        self.members.note("preempted", signal=p.requested, epochs_done=epochs_done, position=position)
        event = self.history.events[-1]
        try:
            now = weights() if callable(weights) else weights
            path = self.save_checkpoint(epochs_done, now, opt_state, mode, outer_state, position=position)
        except Exception as exc:  # the workers went with the signal: the previous checkpoint stands
            why = f" (no new checkpoint: {type(exc).__name__}: {exc})"
            path = str(checkpoint.path_in(self.cfg.run.checkpoint_dir)) if self.cfg.run.checkpoint_dir else None
        requeued = p.requeue()
        event.update(checkpoint=path, requeued=requeued)
        raise Preempted(
            f"{p.requested}: training stopped after {epochs_done} epochs and {position} "
            f"{'rounds' if self.app.sharded else 'rows'} of the next; checkpoint {path}{why}"
            + ("; the Slurm job was requeued" if requeued else ""),
            signal=p.requested,
            checkpoint=path,
            requeued=requeued,
        )

    def save_checkpoint(
        self,
        epochs_done: int,
        weights: list[np.ndarray],
        opt_state: list[np.ndarray] | None,
        mode: str,
        outer_state: list[np.ndarray] | None = None,
        position: int = 0,
    ) -> str | None:
        """Write the run's checkpoint, with each live worker's own state (optimizer, random generators); returns
        its path (None: the run has no checkpoint directory). ``position``: how far into epoch ``epochs_done``."""
        cfg = self.cfg
        if not cfg.run.checkpoint_dir:
            return None
        live = self.members.live()
        # Preempted: the scheduler may be stopping the workers too, and ends this process soon; a worker that does
        # not answer at once is left out (its state restarts fresh on resume). Those stopping (SIGTERM) hold the
        # state of the round the run stops after, and still answer (ddlf.worker.drain); a worker stopped alone
        # earlier does not hold the current state, and is left out of other checkpoints.
        timeout = 3.0 if self.preempted() else None
        if self.preempted():
            live = sorted(set(live) | set(self.members.holding_state()))
        states = self.cluster.call(
            remote.session_state, (self.state.run_id,), workers=live, return_exceptions=True, timeout=timeout
        )
        worker_states = {w: s for w, s in zip(live, states) if not isinstance(s, BaseException)}
        shards = [s["optimizer_shard"] for s in worker_states.values() if s.get("optimizer_shard") is not None]
        if shards:  # sharded optimizer state: the checkpoint holds it whole (pickled once, shared by every state)
            whole = join_shards(shards)
            for s in worker_states.values():
                s["optimizer_shard"] = whole
        checkpoint.save(
            cfg.run.checkpoint_dir,
            epochs_done=epochs_done,
            mode=mode,
            seed=cfg.run.seed,
            weights=[np.asarray(w) for w in weights],
            optimizer_state=opt_state,
            worker_states=worker_states,
            history=self.history,
            outer_state=outer_state,
            position=position,
            strategy=type(cfg.strategy).__name__,
            scale_learning_rate=cfg.scale_learning_rate,
            learning_rate=learning_rate(self.app.model),
        )
        return str(checkpoint.path_in(cfg.run.checkpoint_dir))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two weights hold the same values (NaN equal to NaN: a diverged run's are not changed by reading)."""
    a, b = np.asarray(a), np.asarray(b)
    return np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc")


def _going_away(exc: BaseException) -> bool:
    """Whether ``exc`` says a worker's process is going away (lost, or stopping on a signal), as when the
    scheduler stops the job, rather than that its code failed."""
    return isinstance(exc, WorkerUnavailable) or stopping(exc)
