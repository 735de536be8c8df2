"""One training run on this worker, as one object: the app, its model and dataset, and what the run carries from
round to round (the last reduced weights, top-k residuals, the outer optimizer's momentum, the compiled step).

Its methods are the run's endpoints on this worker (a Monarch actor's shape): the master calls the module-level
functions of :mod:`ddlf.training.replica` by reference, and each hands its typed round to the session it names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import ops
from ...data.structure import Parts
from ...errors import ModelMismatchError, NotFoundError
from ...frameworks.adapter import adapter_for
from ...process import freeze_heap
from ...worker.drain import call_settled
from ..messages import FitData, GradientRound, MasterRound, RingRound, Rows
from ..outer import OuterMomentum, OuterSpec
from . import ring_rounds, rounds
from .dataset import Feed, load, parts_of
from .state import optimizer_built, optimizer_state, rng_state, set_optimizer_state, set_rng_state
from .steppers import stepper_for


@dataclass
class Session:
    """A run set up on this worker (:func:`ddlf.training.replica.setup`)."""

    run_id: str
    app: Any
    model: Any
    parts: Parts
    """The dataset (this worker's shard of it, for a sharded app)."""
    rows: int
    """Rows that train (without those ``validation_split`` holds out)."""
    fit: FitData = field(default_factory=FitData)
    n_shards: int = 0
    """0: the whole dataset on every worker."""
    collective: bool = False
    """The run all-reduces worker to worker (the ring): one such run at most holds a daemon (``RingBusy``)."""
    identity: bytes = b""
    """Digest of the app as received: names its dataset's copy on the host (node_store)."""
    residual: list[np.ndarray] | None = None
    """Top-k error feedback: what earlier rounds did not send."""
    reduced: tuple[int, list[np.ndarray], list[np.ndarray]] | None = None
    """On the ring: (round, weights before it, weights after it) of the last round reduced here."""
    stepper: Any = None
    """The model's training step (:mod:`.steppers`), made on first use."""
    optimizer_start: list[np.ndarray] | None = None
    """With gradient averaging: the optimizer state the last round started from..."""
    rng_start: list[np.ndarray] | None = None
    """...the random generators' state it started from..."""
    in_flight: int | None = None
    """...and that round's number while it has not ended here (it failed, or a stop interrupted it): the
    optimizer and the generators have taken some of its steps, which a checkpoint must not keep (:meth:`state`)."""
    outer: OuterMomentum | None = None
    """On the ring with an outer optimizer: its momentum..."""
    outer_start: list[np.ndarray] | None = None
    """...and the momentum the last round started from."""
    sharded: Any = None
    """With ``GradientAveraging(shard_optimizer=True)``: this rank's :class:`~.sharded.ShardedOptimizer`..."""
    restored_shard: Any = None
    """...and the whole optimizer state a checkpoint restored (:class:`~.sharded.Held`), until a round
    redistributes it."""
    warm_key: str | None = None
    """What identifies the model's architecture among kept warm models (:mod:`.warm`); None: not kept."""
    heap_holder: object | None = None
    """Set when the objects alive after this run's first round were set aside from the garbage collector: what
    holds that freeze (:func:`ddlf.process.release_heap` at teardown)."""
    started: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)

    # -- rounds -----------------------------------------------------------------------------------------------

    def train_chunk(self, worker: Any, spec: MasterRound) -> dict[str, Any]:
        """A round through the master (:func:`.rounds.train_chunk`)."""
        return self._settled(rounds.train_chunk(self, worker, spec))

    def train_reduce(self, worker: Any, spec: RingRound) -> dict[str, Any]:
        """A model-averaging round on the ring (:func:`.ring_rounds.train_reduce`)."""
        return self._settled(ring_rounds.train_reduce(self, worker, spec))

    def train_gradients(self, worker: Any, spec: GradientRound) -> dict[str, Any]:
        """A gradient-averaging round on the ring (:func:`.ring_rounds.train_gradients`)."""
        return self._settled(ring_rounds.train_gradients(self, worker, spec))

    def _settled(self, reply: dict[str, Any]) -> dict[str, Any]:
        """A round's reply: a stop (SIGTERM) no longer interrupts it (:mod:`ddlf.worker.drain`). After this run's
        first round (its model built, its steps traced): the worker's objects out of the
        garbage collector's full scans (:func:`ddlf.process.freeze_heap`), given back when the run is torn
        down."""
        call_settled()
        if self.heap_holder is None:
            self.heap_holder = object()
            freeze_heap(self.heap_holder)
        return reply

    def reduced_weights(self, round_no: int | None = None) -> list[np.ndarray]:
        """The weights of the last round reduced here (what every member of the ring holds after it)."""
        reduced = self.reduced
        if reduced is None or (round_no is not None and reduced[0] != round_no):
            raise NotFoundError(f"run {self.run_id}: no reduced weights for round {round_no} here")
        return reduced[2]

    def replace_reduced_weights(self, round_no: int, weights: list[np.ndarray]) -> None:
        """The master's model was given ``weights`` after round ``round_no`` (a callback set them): the next round
        starts here from them, as from that round's result (its optimizer state, or shard, goes on)."""
        reduced = self.reduced
        if reduced is None or reduced[0] != round_no:
            raise NotFoundError(f"run {self.run_id}: no reduced weights for round {round_no} here")
        self.reduced = (round_no, reduced[1], [np.array(w) for w in weights])

    # -- what rounds share ------------------------------------------------------------------------------------

    def steps(self) -> Any:
        """The model's :class:`~.steppers.Stepper` (traced or jitted once per run)."""
        if self.stepper is None:
            self.stepper = stepper_for(self.model)
        return self.stepper

    def shards(self) -> Any:
        """The model's :class:`~.sharded.ShardedOptimizer` (made on first use; the model's own optimizer is then
        never built here)."""
        if self.sharded is None:
            from .sharded import ShardedOptimizer

            self.sharded = ShardedOptimizer(self.model)
            self.steps().sharded = True
        return self.sharded

    def feed(self, rows: Rows, batch_size: int, prefetch: int) -> Feed:
        """The batches a round trains on: ``rows.indices``, or the slice ``rows.seeded`` names of a permutation
        regenerated here (in order without ``shuffle``), of the dataset (with shard rotation, another worker's
        shard: loaded once, then cached here too)."""
        parts, n, indices = self.parts, self.rows, rows.indices
        if self.n_shards and rows.shard is not None:
            item, _ = load(self.app, self.identity, rows.shard, self.n_shards)
            parts = parts_of(item.value, self.fit)
            n = parts.rows
        if rows.seeded is not None:
            seed, epoch, shares, w, start, stop = rows.seeded
            if self.fit.shuffle:
                indices = ops.partition_for(n, seed, epoch, shares, w)[start:stop]
            else:
                indices = np.arange(start, min(stop, n), dtype=np.uint32)
        if indices is None:  # neither: no rows this round (Rows.count() is 0)
            indices = np.empty(0, dtype=np.uint32)
        return Feed(parts, indices, batch_size, prefetch, self.app.preprocess, self.fit)

    # -- state for checkpoints --------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What this worker carries from round to round besides the weights: its optimizer state, its random
        generators' state, its top-k residual and its outer momentum. Saved in checkpoints, so a resumed run
        continues identically."""
        model = self.model
        unfinished = self.in_flight is not None
        return {
            **self.held_optimizer_state(),
            "rng": self.rng_start if unfinished and self.rng_start is not None else rng_state(model),
            "residual": self.residual,
            "outer": self.outer.state() if self.outer is not None else None,
        }

    def held_optimizer_state(self) -> dict[str, Any]:
        """This worker's optimizer state: ``optimizer`` (the model's optimizer, None before it is built) and
        ``optimizer_shard`` (with sharded optimizer state: the shard it holds, :meth:`.sharded.Held.to_dict`)."""
        # A gradient-averaging round that did not end here leaves the optimizer part-way through it: the state
        # that goes with the last reduced weights is the one the round started from.
        unfinished = self.in_flight is not None
        held = None
        if self.sharded is not None:
            # (None when the round started with no state: a torch optimizer in its first round)
            held = self.sharded.start if unfinished else self.sharded.held()
        if held is None and self.restored_shard is not None:
            held = self.restored_shard
        optimizer = None
        if unfinished:
            optimizer = self.optimizer_start  # None: not built when the round started (a fresh one on resume)
        elif optimizer_built(self.model):
            optimizer = optimizer_state(self.model)
        return {"optimizer": optimizer, "optimizer_shard": held.to_dict() if held is not None else None}

    def adopt_optimizer_state(self, state: dict[str, Any]) -> None:
        """Start this run from the master's optimizer state (its model's, as after ``fit``: the last run's, or one
        a callback restored): ``optimizer`` for the model's own optimizer, every variable but the learning rate
        (the rate is the run's: compiled, scaled, or set by a callback), or ``optimizer_shard`` (the whole
        state, with sharded optimizer state: this worker cuts its shard from it at the first round)."""
        if state.get("optimizer_shard") is not None:
            from .sharded import Held

            self.restored_shard = Held.from_dict(state["optimizer_shard"])
        values = state.get("optimizer")
        model = self.model
        adapter = adapter_for(model)
        if values is None:
            return
        if adapter.kind == "torch":
            set_optimizer_state(model, values)  # a fresh torch optimizer gets its state first (TorchModel)
            return
        if adapter.keras_optimizer() is None:
            return  # no optimizer to take it
        adapter.build_optimizer()
        variables = model.optimizer.variables
        if len(variables) != len(values) or any(tuple(v.shape) != np.shape(a) for v, a in zip(variables, values)):
            raise ModelMismatchError(
                f"the master's optimizer state ({len(values)} arrays) does not fit this worker's optimizer "
                f"({len(variables)} variables, for the {len(model.trainable_variables)} weights the model trains): "
                "where a layer's trainable flag changed after the master's optimizer was built, compile the model "
                "again with a new optimizer (as Keras needs for the change to take effect); else create_model must "
                "build the same model and optimizer everywhere"
            )
        set_optimizer_state(model, values, keep_learning_rate=True)

    def restore(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`state` returned (after setup on a fresh or restarted worker)."""
        model = self.model
        if state.get("optimizer") is not None:
            adapter_for(model).build_optimizer()
            # the rate is the run's, as in adopt_optimizer_state: the saved one is scaled by the workers of the run
            # that saved it (taken as this run's base, it was scaled again at each resume)
            keep = bool(state.get("keep_learning_rate", True))
            set_optimizer_state(model, state["optimizer"], keep_learning_rate=keep)
        set_rng_state(model, state.get("rng", []))
        if state.get("optimizer_shard") is not None:
            from .sharded import Held

            self.restored_shard = Held.from_dict(state["optimizer_shard"])
        self.residual = state.get("residual")
        if state.get("outer") is not None:
            self.outer = OuterMomentum(OuterSpec())  # the spec comes with the next round
            self.outer.load(state["outer"])
