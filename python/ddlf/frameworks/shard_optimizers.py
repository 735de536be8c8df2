"""A model's own optimizer on one flat shard of its trainable weights, for :mod:`ddlf.training.replica.sharded` (ZeRO
stage 1): one class per framework, each built from the model's compiled optimizer (its class, config and learning-
rate schedule) and stepping a 1-D float32 shard with the gradient's mean for it.

The state of such an optimizer is :attr:`slots` (arrays as long as the shard: Adam's two moments, momentum) and
:attr:`scalars` (the same on every rank: the step count, NAdam's running product).
:mod:`~ddlf.training.replica.sharded` moves, joins and checkpoints them as numpy arrays and never looks inside.

- :class:`KerasShard`: a Keras optimizer of :data:`KERAS_ELEMENTWISE` on one ``keras.Variable``; its state is built
  (zeros, step 0) with the shard.
- :class:`TorchShard`: a ``torch.optim`` optimizer of :data:`TORCH_ELEMENTWISE` (one parameter group) on one
  ``torch.nn.Parameter``; torch creates an optimizer's state at its first step, so until then the shard holds none
  (:attr:`~TorchShard.slots` is empty, as in a fresh ``torch.optim`` optimizer) and a state handed to it is put
  in the layout torch would make (:meth:`TorchShard.load`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .adapter import adapter_for

KERAS_ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl")
"""The Keras optimizers whose step treats every element on its own, so that a step on a flat shard is exactly
the step on each weight (Lamb and Adafactor look at whole weights: their state cannot be cut this way)."""

TORCH_ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam")
"""The ``torch.optim`` optimizers whose step treats every element on its own (LBFGS, SparseAdam and Rprop's
per-element step sizes that start at the learning rate are left out)."""


def trainable_variables(model: Any) -> list[Any]:
    """The weights an optimizer trains, in the order the stepper hands their gradients: a Keras model's
    ``trainable_weights``, or a :class:`ddlf.models.TorchModel`'s parameters that require a gradient."""
    return adapter_for(model).trainable_variables()


def shard_optimizer_for(model: Any) -> KerasShard | TorchShard:
    """The shard optimizer for ``model``'s framework (``model`` passed
    :func:`ddlf.training.replica.sharded.check_shardable`)."""
    return TorchShard(model) if adapter_for(model).kind == "torch" else KerasShard(model)


class KerasShard:
    """The model's Keras optimizer (its config and schedule) on one ``keras.Variable``: the shard."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.optimizer: Any = None
        self.variable: Any = None
        self.slots: list[Any] = []
        self.scalars: list[Any] = []
        self.clip: float | None = None  # the optimizer's global_clipnorm, applied by the caller over every shard
        self.clip_epsilon = 0.0  # Keras's clip_by_global_norm divides by the norm itself
        self._apply: Any = None  # on TensorFlow: the step as one graph (see build)

    def build(self, size: int) -> None:
        """A new optimizer on a shard of ``size`` elements (its state zeros, step 0)."""
        import keras

        source = self.model.optimizer
        config = source.get_config()
        rate = getattr(source, "_learning_rate", None)
        if callable(rate):  # a schedule (the user's own class too): the same object, driven by this step count
            config["learning_rate"] = rate
        self.clip = config.get("global_clipnorm")
        config["global_clipnorm"] = None  # clipped by the caller, by the norm over every rank's shard
        self.optimizer = type(source).from_config(config)
        self.variable = keras.Variable(np.zeros(size, np.float32), dtype="float32", trainable=True, name="ddlf_shard")
        self.optimizer.build([self.variable])
        own = {id(self.variable)}
        self.slots = [v for v in self.optimizer.variables if len(v.shape) == 1 and id(v) not in own]
        self.scalars = [v for v in self.optimizer.variables if len(v.shape) == 0]
        self._apply = None
        # Compiled where fit would compile the model's step: not with run_eagerly, and on JAX only with jit_compile.
        backend = keras.backend.backend()
        compiled = size and not getattr(self.model, "run_eagerly", False)
        if backend == "tensorflow" and compiled:
            # One graph per step, as the steppers' (``autograph=False`` like theirs): eagerly, each of the
            # update's element-wise ops is dispatched from Python and makes its own temporary (Adam on a
            # 2.9 M-element shard: 23 ms a step eagerly, 15 ms as a graph).
            import tensorflow as tf  # type: ignore[import-untyped]

            optimizer, variable = self.optimizer, self.variable

            def apply(mean: Any) -> None:
                optimizer.apply([mean], [variable])

            self._apply = tf.function(apply, input_signature=[tf.TensorSpec([size], tf.float32)], autograph=False)
        elif backend == "jax" and compiled and getattr(self.model, "jit_compile", True):
            # Compiled, as fit compiles its step: the optimizer's stateless step on the variables' values (Adam
            # on a 2.9 M-element shard: 21 ms a step eagerly, 13 ms compiled; within float32 rounding of it).
            import jax

            optimizer, variable, state = self.optimizer, self.variable, list(self.optimizer.variables)
            stateless = jax.jit(lambda values, weights, mean: optimizer.stateless_apply(values, [mean], [weights]))

            def apply_jax(mean: Any) -> None:
                weights, values = stateless([v.value for v in state], variable.value, mean)
                variable.assign(weights[0])
                for v, value in zip(state, values):
                    v.assign(value)

            self._apply = apply_jax

    def kinds(self) -> tuple[int, int]:
        """How many slot and scalar arrays this optimizer's state has."""
        if self.optimizer is None:
            self.build(0)
        return len(self.slots), len(self.scalars)

    def state(self) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
        """Copies of the slots and scalars."""
        return [np.array(v.numpy(), np.float32) for v in self.slots], [np.array(v.numpy()) for v in self.scalars]

    def load(self, slots: list[np.ndarray], scalars: list[np.ndarray] | None) -> None:
        """Take ``slots`` (and ``scalars``, unless None: the step count stays)."""
        for v, a in zip(self.slots, slots):
            v.assign(np.array(a))  # a copy, as in write()
        if scalars is not None:
            for v, a in zip(self.scalars, scalars):
                _assign_scalar(v, a)

    def write(self, values: np.ndarray) -> None:
        """Set the shard's weights (copied: on JAX a variable assigned a 64-byte aligned numpy array keeps that
        memory as its value, and ``values`` is a view of a buffer the next step overwrites)."""
        self.variable.assign(np.array(values))

    def step(self, mean: np.ndarray) -> np.ndarray:
        """One step with the gradient ``mean`` of the shard; the new weights."""
        import keras

        self._sync_learning_rate()
        if not len(mean):  # nothing here (more ranks than elements): the step count moves with the others'
            self.optimizer.iterations.assign_add(1)
            return mean
        if self._apply is not None:
            self._apply(mean)
        else:
            self.optimizer.apply([keras.ops.convert_to_tensor(mean)], [self.variable])
        return np.asarray(self.variable.numpy())

    def state_bytes(self) -> int:
        return int(sum(int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize for v in self.slots))

    def _sync_learning_rate(self) -> None:
        """Take the model's optimizer's learning rate (a warm-up, ``set_learning_rate``, a callback change it
        there); a schedule is the shard optimizer's own, driven by the same step count."""
        source: Any = getattr(self.model.optimizer, "_learning_rate", None)
        own: Any = getattr(self.optimizer, "_learning_rate", None)
        if hasattr(source, "assign") and hasattr(own, "assign"):
            own.assign(np.asarray(source.numpy() if hasattr(source, "numpy") else source))


def _assign_scalar(variable: Any, value: Any) -> None:
    dtype = np.dtype(variable.dtype)
    a = np.asarray(value, np.float64)
    variable.assign((np.rint(a) if dtype.kind in "iu" else a).astype(dtype))


class TorchShard:
    """The :class:`ddlf.models.TorchModel`'s ``torch.optim`` optimizer (its class and its one parameter group's
    hyperparameters, which it follows: a learning-rate scheduler or the linear scaling rule sets them on the model's
    optimizer) on one ``torch.nn.Parameter``: the shard."""

    clip_epsilon = 1e-6
    """Added to the norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` adds it."""

    def __init__(self, model: Any) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.clip: float | None = getattr(model, "clip_grad_norm", None)
        """``TorchModel(clip_grad_norm=)``: applied by the caller, by the norm over every rank's shard."""
        # The model's own optimizer never steps here: what torch made at its construction (Adagrad's sums) goes.
        model.optimizer.state.clear()
        self.optimizer: Any = None
        self.variable: Any = None
        self._layout: list[tuple[str, str, Any]] | None = None

    def build(self, size: int) -> None:
        """A new optimizer on a shard of ``size`` elements, with no state yet (torch makes it at the first step)."""
        torch = self.torch
        source = self.model.optimizer
        self.variable = torch.nn.Parameter(torch.zeros(size, dtype=torch.float32, device=self._device()))
        self.optimizer = _like(source, self.variable)
        self._layout = None  # found again from the optimizer's hyperparameters now (momentum may have changed)

    def _device(self) -> Any:
        return next((p.device for p in trainable_variables(self.model)), self.torch.device("cpu"))

    def layout(self) -> list[tuple[str, str, Any]]:
        """The optimizer's state, as torch makes it at a first step: ``(key, "slot" | "scalar" | "other",
        template)`` in key order (found on a throwaway optimizer of the same class and hyperparameters, on the
        model's device: a ``fused`` or ``capturable`` optimizer keeps its step count there)."""
        if self._layout is None:
            torch = self.torch
            source = self.model.optimizer
            probe = torch.nn.Parameter(torch.zeros(2, dtype=torch.float32, device=self._device()))
            throwaway = _like(source, probe)
            probe.grad = torch.zeros_like(probe)
            throwaway.step()
            state = throwaway.state[probe]
            self._layout = [
                (
                    key,
                    _kind(torch, state[key]),
                    state[key].detach().clone() if torch.is_tensor(state[key]) else state[key],
                )
                for key in sorted(state)
            ]
        return self._layout

    def kinds(self) -> tuple[int, int]:
        layout = self.layout()
        return sum(k == "slot" for _, k, _ in layout), sum(k == "scalar" for _, k, _ in layout)

    @property
    def _state(self) -> dict[str, Any]:
        return self.optimizer.state.get(self.variable) or {}

    @property
    def slots(self) -> list[Any]:
        """The state's arrays as long as the shard (none before the first step)."""
        state = self._state
        return [state[k] for k, kind, _ in self.layout() if kind == "slot" and k in state]

    def state(self) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
        """Copies of the slots and scalars; None before the first step (the optimizer holds nothing yet)."""
        state = self._state
        if not state:
            return None
        slots = [_numpy(state[k], np.float32) for k, kind, _ in self.layout() if kind == "slot"]
        scalars = [_numpy(state[k], None) for k, kind, _ in self.layout() if kind == "scalar"]
        return slots, scalars

    def load(self, slots: list[np.ndarray], scalars: list[np.ndarray] | None) -> None:
        """Take ``slots`` and ``scalars`` as the state (made in torch's layout where none is yet); ``scalars`` None
        (no rank held a state) leaves the fresh one."""
        if scalars is None:
            return  # nobody held a state: it stays fresh (made at the first step; Adagrad's at construction)
        torch = self.torch
        state = self.optimizer.state[self.variable]
        slot_values, scalar_values = iter(slots), iter(scalars or [])
        with torch.no_grad():
            for key, kind, template in self.layout():
                if kind == "other":
                    state.setdefault(key, template)
                    continue
                value = next(slot_values) if kind == "slot" else next(scalar_values, None)
                if value is None:
                    continue
                target = state.get(key)
                like = target if target is not None else template
                tensor = torch.as_tensor(np.asarray(value)).to(dtype=like.dtype, device=self.variable.device)
                if kind == "scalar":
                    tensor = tensor.reshape(like.shape).to(device=like.device)
                if target is None:
                    state[key] = tensor.clone()
                else:
                    target.copy_(tensor)

    def write(self, values: np.ndarray) -> None:
        with self.torch.no_grad():
            self.variable.copy_(self.torch.from_numpy(values))

    def step(self, mean: np.ndarray) -> np.ndarray:
        """One step with the gradient ``mean`` of the shard (read in place); the new weights."""
        self._sync_hyperparameters()
        self.variable.grad = self.torch.from_numpy(mean).to(self.variable.device)
        self.optimizer.step()
        self.variable.grad = None
        return self.variable.detach().cpu().numpy()

    def _sync_hyperparameters(self) -> None:
        """The model's optimizer's hyperparameters (its learning rate, the betas a one-cycle scheduler moves)."""
        self.optimizer.param_groups[0].update(_group(self.model.optimizer))

    def state_bytes(self) -> int:
        return int(sum(t.numel() * t.element_size() for t in self.slots))


def _group(optimizer: Any) -> dict[str, Any]:
    """An optimizer's one parameter group's hyperparameters."""
    return {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}


def _like(source: Any, param: Any) -> Any:
    """An optimizer of ``source``'s class over ``param`` alone, with its hyperparameters (those its constructor
    takes, then its parameter group's: AdamW's constructor does not take every default it records)."""
    import inspect

    takes = inspect.signature(type(source).__init__).parameters
    anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values())
    made = type(source)([param], **{k: v for k, v in source.defaults.items() if anything or k in takes})
    made.param_groups[0].update(_group(source))
    return made


def _kind(torch: Any, value: Any) -> str:
    if not torch.is_tensor(value):
        return "other"
    return "scalar" if value.dim() == 0 else "slot"


def _numpy(tensor: Any, dtype: Any) -> np.ndarray:
    a = tensor.detach().cpu().numpy()
    return np.array(a, dtype) if dtype is not None else np.array(a)
