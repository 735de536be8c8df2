"""Sharded optimizer state for :class:`~ddlf.GradientAveraging` (``shard_optimizer=True``: ZeRO stage 1).

Each of a ring's ``n`` ranks keeps the optimizer state (Adam's two moments, momentum, ...) of one ``1/n`` shard of
the model's trainable weights only. A step:

1. backward gives this batch's gradients; they go, weighted by the batch's rows, into one flat float32 buffer;
2. the ring **reduce-scatters** it (``Ring.reduce_scatter_``): this rank ends with the sum of its shard only, and a
   one-element all-reduce sums the rows, so the shard becomes the rows-weighted mean, as unsharded gradient
   averaging computes it;
3. this rank's own optimizer (a copy of the model's compiled optimizer, its config and schedule, built on one flat
   variable: the shard of the weights; a Keras or a ``torch.optim`` optimizer, :mod:`.shard_optimizers`) takes the
   step on the shard;
4. the ring **all-gathers** the new weights (``Ring.allgather_``), and every rank writes them into its model.

Each rank sends ``2 (n-1)/n`` times the weights per step, as an all-reduce of the gradients does, and holds
``1/n`` of the optimizer state. Exact for element-wise optimizers (:data:`KERAS_ELEMENTWISE`,
:data:`TORCH_ELEMENTWISE`), whose step on a flat shard is their step on each weight: replicas stay bit-identical
(the all-gather hands every rank the same bits).
Everything else is refused by :func:`check_shardable` before training starts, with the reason.

The shards are cut by the ring (``Ring.shard``). When the ring changes (a worker lost, one joining, a run resumed
from a checkpoint on another number of workers), :func:`redistribute` moves the state to the new shards: every
rank adds what it holds into full-length buffers, the ring sums them, and each rank takes its new shard (the
elements no survivor held, a lost worker's shard, restart from zeros: reported, and warned about by the master).
Checkpoints hold the whole state (the master joins the shards, :func:`join`); a resumed run redistributes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import ConfigError, InvalidStateError, ModelMismatchError
from ...frameworks.adapter import adapter_for
from ...frameworks.shard_optimizers import (
    KERAS_ELEMENTWISE,
    TORCH_ELEMENTWISE,
    KerasShard,
    TorchShard,
    shard_optimizer_for,
    trainable_variables,
)


def check_shardable(model: Any) -> None:
    """Raise :class:`~ddlf.errors.ConfigError` (with the reason and what to do) unless ``model``'s optimizer state
    can be sharded: a compiled Keras model (its own ``train_step`` not overridden) or a
    :class:`ddlf.models.TorchModel`, with float32 trainable weights and an element-wise optimizer
    (:data:`KERAS_ELEMENTWISE`: without per-weight clipping (``clipnorm``; ``global_clipnorm`` is kept: the ranks sum
    their shards' squared norms), averaging (``use_ema``) or accumulation, and with weight decay (if any) for every
    weight alike; :data:`TORCH_ELEMENTWISE`: one parameter group)."""
    adapter = adapter_for(model)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ConfigError(f"{_WHAT} needs a compiled model (create_model must compile it)")
    if adapter.kind == "torch":
        _check_torch(optimizer, model)
    else:
        if adapter.overrides_train_step():
            raise ConfigError(f"{_WHAT} cannot run {type(model).__name__}'s own train_step: use shard_optimizer=False")
        _check_keras(optimizer)
    weights = trainable_variables(model)
    odd = [w for w in weights if _dtype_name(w) != "float32"]
    if odd:
        raise ConfigError(
            f"{_WHAT}: trainable weights must be float32 (the shard is one float32 buffer); "
            f"{_name(odd[0])} is {_dtype_name(odd[0])}"
        )
    if adapter.kind != "torch" and getattr(optimizer, "weight_decay", None):
        decayed = {bool(optimizer._use_weight_decay(w)) for w in weights}
        if len(decayed) > 1:
            raise ConfigError(
                f"{_WHAT}: the optimizer decays some weights and not others (exclude_from_weight_decay); a shard "
                "mixes them: use shard_optimizer=False"
            )


_WHAT = "GradientAveraging(shard_optimizer=True)"


def _check_keras(optimizer: Any) -> None:
    cls = type(optimizer)
    if cls.__name__ not in KERAS_ELEMENTWISE or not cls.__module__.startswith("keras"):
        raise ConfigError(
            f"{_WHAT}: the optimizer {cls.__module__}.{cls.__name__} is not one whose state can be cut into shards "
            f"(element-wise Keras optimizers only: {', '.join(KERAS_ELEMENTWISE)}); use shard_optimizer=False"
        )
    for option in ("clipnorm", "use_ema", "gradient_accumulation_steps"):
        if getattr(optimizer, option, None):
            raise ConfigError(
                f"{_WHAT}: the optimizer's {option}={getattr(optimizer, option)!r} needs whole weights (or all of "
                "them) on one worker; use clipvalue, or shard_optimizer=False"
            )


def _check_torch(optimizer: Any, model: Any) -> None:
    if getattr(model, "scaler", None) is not None:
        raise ConfigError(
            f"{_WHAT}: TorchModel(precision='16-mixed') scales its loss with a gradient scaler, whose unscaling and "
            "skipped steps the shards' optimizers do not run: use precision='bf16-mixed' (no scaler) or "
            "shard_optimizer=False"
        )
    cls = type(optimizer)
    if cls.__name__ not in TORCH_ELEMENTWISE or not cls.__module__.startswith("torch.optim"):
        raise ConfigError(
            f"{_WHAT}: the optimizer {cls.__module__}.{cls.__name__} is not one whose state can be cut into shards "
            f"(element-wise torch.optim optimizers only: {', '.join(TORCH_ELEMENTWISE)}); use shard_optimizer=False"
        )
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if trained != {id(p) for p in trainable_variables(model)}:
        raise ConfigError(
            f"{_WHAT}: the optimizer trains {len(trained)} parameters and the module has "
            f"{len(trainable_variables(model))} that require a gradient; sharded, the shard's optimizer would "
            "train them all: give the optimizer every parameter that requires a gradient (freeze the others with "
            "requires_grad=False), or use shard_optimizer=False"
        )
    if len(optimizer.param_groups) != 1:
        raise ConfigError(
            f"{_WHAT}: the optimizer has {len(optimizer.param_groups)} parameter groups; a shard of the flat weights "
            "mixes them, so it needs one (the same hyperparameters for every weight): use shard_optimizer=False"
        )


def _dtype_name(w: Any) -> str:
    dtype = w.dtype
    if type(dtype).__module__.startswith("torch"):  # torch.float32 -> "float32"
        return str(dtype).removeprefix("torch.")
    return str(np.dtype(dtype))


def _name(w: Any) -> str:
    return str(getattr(w, "path", None) or getattr(w, "name", None) or tuple(w.shape))


@dataclass
class Held:
    """Optimizer state this rank holds: ``slots[k][i]`` is slot ``k`` (Adam: first and second moment) of element
    ``start + i`` of the flat weights (``length`` elements in all); ``scalars``: the optimizer's scalar state
    (its step count), the same on every rank."""

    length: int
    start: int
    slots: list[np.ndarray]
    scalars: list[np.ndarray]

    @property
    def stop(self) -> int:
        return self.start + (len(self.slots[0]) if self.slots else 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "length": self.length,
            "start": self.start,
            "slots": self.slots,
            "scalars": self.scalars,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Held:
        return cls(int(d["length"]), int(d["start"]), list(d["slots"]), list(d["scalars"]))


def join(states: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The whole optimizer state from the ranks' shards (:meth:`Held.to_dict` each; a checkpoint stores it):
    ``start`` 0 and full-length slots, the elements no shard covered left at zero (``missing`` counts them)."""
    if not states:
        return None
    length = int(states[0]["length"])
    kinds = len(states[0]["slots"])
    slots = [np.zeros(length, np.float32) for _ in range(kinds)]
    covered = np.zeros(length, bool)
    for s in states:
        if int(s["length"]) != length or len(s["slots"]) != kinds:
            raise ModelMismatchError("optimizer shards of different models cannot be joined")
        a = int(s["start"])
        for k, part in enumerate(s["slots"]):
            slots[k][a : a + len(part)] = part
            if k == 0:
                covered[a : a + len(part)] = True
    return {
        "length": length,
        "start": 0,
        "slots": slots,
        "scalars": list(states[0]["scalars"]),
        "missing": int(length - covered.sum()),
    }


class ShardedOptimizer:
    """One rank's part of a model's training step with sharded optimizer state (see the module docs)."""

    def __init__(self, model: Any) -> None:
        check_shardable(model)
        self.model = model
        self.variables = trainable_variables(model)
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.length = int(sum(self.sizes))
        # One flat buffer serves both halves of a step: the gradients go in and are reduce-scattered, then the
        # new weights are all-gathered in it (one model's worth of memory, not two).
        self.flat = np.empty(self.length, np.float32)
        self.weight_views = self._views(self.flat)
        self.range: tuple[int, int] | None = None
        self.local: KerasShard | TorchShard = shard_optimizer_for(model)  # the model's optimizer on this rank's shard
        self.start: Held | None = None  # the state when the round started (a redo restarts from it)

    def _views(self, flat: np.ndarray) -> list[np.ndarray]:
        out, at = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            out.append(flat[at : at + size].reshape(shape))
            at += size
        return out

    # -- the shard ------------------------------------------------------------------------------------------

    def _build(self, start: int, stop: int) -> None:
        """A new optimizer (the model's config) on the shard ``start:stop``, its state fresh."""
        self.local.build(stop - start)
        self.range = (start, stop)

    def held(self) -> Held | None:
        """The state this rank holds (None before its first round, and with a torch optimizer before its first
        step: torch makes the state then)."""
        if self.range is None:
            return None
        state = self.local.state()
        if state is None:
            return None
        return Held(self.length, self.range[0], *state)

    def load(self, held: Held) -> None:
        """Put back :meth:`held`'s state (this rank's range must be the same)."""
        assert self.range == (held.start, held.stop), (self.range, held.start, held.stop)
        self.local.load(held.slots, held.scalars)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return self.local.state_bytes()

    def begin(self, ring: Any, plan: str, fresh: bool, restored: Held | None, start: list[np.ndarray]) -> int:
        """A round starts from the model weights ``start`` (trainable ones, in order) on ``ring`` (this rank's
        ``ddlf._ddlf.Ring``). ``plan``: ``"keep"`` (the ring of the last round: the state stays), ``"redo"`` (that
        round failed: back to its start, then redistributed over the new ring), ``"reshard"`` (the members
        changed: redistributed), ``"fresh"`` (nothing held anywhere: zeros). ``fresh``: this worker is new to the
        ring (what it may still hold is stale; a ``restored`` checkpoint state is not). Returns the elements whose
        state no rank held (restarting from zeros)."""
        if plan == "redo" and self.range is not None:
            if self.start is not None:
                self._rebuild_at(self.start.start, self.start.stop)
                self.load(self.start)
            else:  # it held nothing when the round started (a torch optimizer before its first step)
                self._build(*self.range)
        a, b = ring.shard(self.length)
        missing = 0
        if plan == "keep":
            if self.range != (a, b):
                raise InvalidStateError(
                    f"told to keep optimizer shard {self.range} on a ring that gives this worker {(a, b)}"
                )
        elif plan == "fresh":
            self._build(a, b)
        else:
            held = restored if restored is not None else (None if fresh else self.held())
            slots, scalars, missing = redistribute(held, self.length, self.local.kinds(), (a, b), ring)
            self._build(a, b)
            self.local.load(slots, scalars)  # scalars None: no rank held a state (a torch optimizer's stays fresh)
        for view, w in zip(self.weight_views, start):
            view[...] = w
        self.local.write(self.flat[a:b])
        self.start = self.held()
        return missing

    def _rebuild_at(self, start: int, stop: int) -> None:
        if self.range != (start, stop):
            self._build(start, stop)

    # -- a step ---------------------------------------------------------------------------------------------

    def step(self, grads: list[np.ndarray] | None, weight: float, ring: Any, wire: str | None) -> str:
        """One step: this rank's ``grads`` (None: no batch, or left out) with ``weight`` (its rows over the
        batch size) reduce-scattered, the shard stepped, the weights all-gathered into :attr:`weight_views`. Returns
        ``"step"``; ``"none"`` when no rank had a row, ``"overflow"`` when some rank's shard of the average is not
        finite (half precision on the wire overflowed): then no rank steps and nothing changed anywhere."""
        if grads is None:
            self.flat.fill(0.0)
        else:
            at = 0
            for g, size in zip(grads, self.sizes):
                np.multiply(np.ravel(g), np.float32(weight), out=self.flat[at : at + size])
                at += size
        a, b = ring.reduce_scatter_(self.flat, "sum", wire=wire)
        mean = self.flat[a:b]
        clip = self.local.clip
        # The rows, whether any rank's shard overflowed, and (to clip by the global norm) the squared norm of the
        # sum, in one call.
        square = float(np.einsum("i,i->", mean, mean, dtype=np.float64)) if clip else 0.0
        total = np.array([weight, 0.0 if np.isfinite(mean).all() else 1.0, square], np.float64)
        ring.allreduce_([total], "sum")
        if total[0] <= 0:
            return "none"
        if total[1] > 0:
            return "overflow"
        scale = 1.0 / total[0]
        if clip:  # as Keras's clip_by_global_norm (torch's clip_grad_norm_), on the mean over every rank's shard
            norm = np.sqrt(total[2]) * scale + self.local.clip_epsilon
            scale *= min(clip / norm, 1.0) if norm > 0 else 1.0
        mean *= np.float32(scale)
        self.flat[a:b] = self.local.step(mean)
        ring.allgather_(self.flat)  # the other shards' partial sums are overwritten by their new weights
        return "step"


def redistribute(
    held: Held | None, length: int, kinds: tuple[int, int], new: tuple[int, int], ring: Any
) -> tuple[list[np.ndarray], list[np.ndarray] | None, int]:
    """Every rank of ``ring`` calls this with what it holds: each takes the slots of its ``new`` shard (the mean
    of what the ranks that held an element held: they hold the same) and the scalars of any holder. Returns the
    slots, the scalars (None: nobody held any) and the elements nobody held (zeros)."""
    n_slots, n_scalars = kinds
    a, b = new
    count = np.zeros(length, np.float32)
    if held is not None:
        count[held.start : held.stop] += 1.0
    ring.allreduce_([count], "sum")
    have = count[a:b]
    missing = int(np.count_nonzero(count == 0))
    slots = []
    for k in range(n_slots):
        buf = np.zeros(length, np.float32)
        if held is not None and k < len(held.slots):
            buf[held.start : held.stop] = held.slots[k]
        ring.allreduce_([buf], "sum")
        mine = buf[a:b]
        np.divide(mine, np.maximum(have, 1.0), out=mine)
        slots.append(np.array(mine))
        del buf
    wide = np.zeros(n_scalars + 1, np.float64)
    if held is not None and len(held.scalars) == n_scalars:
        wide[:n_scalars] = [float(np.asarray(s)) for s in held.scalars]
        wide[n_scalars] = 1.0
    ring.allreduce_([wide], "sum")
    scalars = None
    if wide[n_scalars] > 0:
        scalars = [np.asarray(v / wide[n_scalars]) for v in wide[:n_scalars]]
    if wide[n_scalars] == 0 or not n_slots:
        # No rank held a state (a torch optimizer before its first step: a redo of the first round starts fresh, as
        # it would have), or the optimizer keeps none per weight (SGD without momentum): nothing went with a
        # worker. Every rank decides alike (the sums are the ring's).
        missing = 0
    return slots, scalars, missing
