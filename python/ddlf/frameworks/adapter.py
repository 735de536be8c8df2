"""What training asks of a model, one adapter per framework: Keras (on TensorFlow, JAX or torch) and
:class:`ddlf.models.TorchModel`.

Training code never looks at a model's type: it asks :func:`adapter_for` once for a model's adapter and calls it
for the model's optimizer state, random-generator state, learning rate, metrics, the weights the optimizer trains
and which step and sharded optimizer fit it (``kind``, read by :mod:`ddlf.training.replica.steppers`). Adding a
framework, or Keras on a new backend, is one class here.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np

from ..errors import ConfigError, InvalidStateError, OptimizerStateWarning
from . import torch_optimizer

Kind = Literal["keras-tensorflow", "keras-jax", "keras-torch", "torch"]
"""Which framework a model trains with: Keras and its backend, or a ``TorchModel``."""

LEARNING_RATE = "learning_rate"
"""The name of a Keras optimizer's learning-rate variable (a plain rate; a schedule has none)."""


class ModelAdapter(ABC):
    """One model seen through its framework (see the module's docs). Subclasses: :class:`KerasAdapter`,
    :class:`TorchModelAdapter`."""

    kind: ClassVar[Kind]

    def __init__(self, model: Any) -> None:
        # Weakly: ``adapter_for``'s cache is keyed weakly by the model, and a value that held its key strongly would
        # keep every model a daemon ever trained alive (the soak's Keras-on-JAX daemons grew 0.3 MiB per run).
        try:
            self._model: Callable[[], Any] = weakref.ref(model)
        except TypeError:  # no weak references to it: held, and adapter_for does not cache it either
            self._model = lambda: model

    @property
    def model(self) -> Any:
        """The model this adapter sees (it must outlive the adapter: callers hold the model, not the adapter)."""
        model = self._model()
        if model is None:
            raise InvalidStateError("this adapter's model was garbage-collected; call adapter_for(model) again")
        return model

    # -- the weights and the optimizer ---------------------------------------------------------------------------

    @abstractmethod
    def trainable_variables(self) -> list[Any]:
        """The weights the optimizer trains, in the order a stepper hands their gradients."""

    @abstractmethod
    def untrained_mask(self) -> list[bool]:
        """For each array of ``get_weights()``: True where it is a float weight the optimizer does not train
        (BatchNorm's moving mean and variance), which each replica updates from its own batches."""

    def keras_optimizer(self) -> Any | None:
        """The model's compiled Keras optimizer (None: none compiled, or not a Keras model)."""
        return None

    @abstractmethod
    def optimizer_built(self) -> bool:
        """Whether the optimizer has its state yet (Keras builds it on the first step, torch on its first step)."""

    def build_optimizer(self) -> None:  # noqa: B027 - nothing to do unless a framework says so
        """Create the optimizer's state now where the framework can (Keras); elsewhere it comes with a step."""

    @abstractmethod
    def optimizer_state(self) -> list[np.ndarray]:
        """The optimizer's state arrays, in a fixed order."""

    def optimizer_layout(self) -> np.ndarray | None:
        """Which parameters hold an optimizer state, where that varies (torch: one that never stepped holds none);
        None where it does not (Keras builds every trainable weight's)."""
        return None

    def conform_optimizer(self, layout: np.ndarray) -> None:  # noqa: B027 - only where a layout varies
        """Give an optimizer state to exactly the parameters ``layout`` (:meth:`optimizer_layout`) names, so that
        this replica's state has another's shape."""

    @abstractmethod
    def optimizer_state_bytes(self) -> int:
        """The bytes of :meth:`optimizer_state`, read off the optimizer's tensors without copying them."""

    @abstractmethod
    def set_optimizer_state(self, state: list[np.ndarray], *, keep_learning_rate: bool = False) -> None:
        """Put back what :meth:`optimizer_state` returned; an optimizer not built yet adopts it next round.
        ``keep_learning_rate``: a Keras optimizer keeps its own rate (the state came from another process)."""

    def set_learning_rate(self, value: float) -> None:  # noqa: B027 - only a Keras optimizer has a plain rate
        """Train with learning rate ``value`` from now on (a plain Keras rate; a schedule is left as it is)."""

    def learning_rate_schedule(self) -> Any | None:
        """The Keras learning-rate schedule driving the optimizer, if one does."""
        return None

    def plain_learning_rate(self) -> bool:
        """Whether the Keras optimizer's rate is a variable (assignable; neither a schedule nor a callable)."""
        return False

    def overrides_train_step(self) -> bool:
        """Whether the model brings its own ``train_step`` (Keras' guide *Customizing what happens in fit*)."""
        return False

    # -- random generators ---------------------------------------------------------------------------------------

    seeds_torch: ClassVar[bool] = False
    """Whether the model holds torch generators of its own that may be made as it is built (a worker seeds torch
    again after building it)."""

    @abstractmethod
    def rng_state(self) -> list[np.ndarray]:
        """The model's random generators' state (dropout)."""

    @abstractmethod
    def set_rng_state(self, state: list[np.ndarray]) -> None:
        """Put back what :meth:`rng_state` returned."""

    # -- metrics and outputs -------------------------------------------------------------------------------------

    def keeps_keras_metrics(self) -> bool:
        """Whether the model keeps Keras metrics (a loss tracker and compiled metrics with variables)."""
        return False

    def predict_on_batch(self, x: Any) -> Any:
        """The model's outputs for one batch."""
        return self.model.predict(x)

    def restored_epoch(self) -> int | None:
        """The epoch ``keras.callbacks.BackupAndRestore`` restored the model at (as ``fit`` reads it), if any."""
        return None

    def forget_restored_epoch(self) -> None:  # noqa: B027 - only Keras restores an epoch
        """Clear what :meth:`restored_epoch` reads, as ``fit`` does when it starts."""

    def clear_stop_training(self) -> None:  # noqa: B027 - only a Keras model has the flag
        """Clear the flag a Keras callback sets to stop training (``model.stop_training``), as ``fit`` does when
        it starts."""


class KerasAdapter(ModelAdapter):
    """A Keras model, on the backend this process runs."""

    def trainable_variables(self) -> list[Any]:
        return list(self.model.trainable_weights)

    def untrained_mask(self) -> list[bool]:
        trained = {id(v) for v in self.model.trainable_weights}
        return [id(v) not in trained and np.dtype(v.dtype).kind == "f" for v in self.model.weights]

    def keras_optimizer(self) -> Any | None:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not hasattr(optimizer, "variables") or not hasattr(optimizer, "build"):
            return None
        return optimizer

    def optimizer_built(self) -> bool:
        return bool(self.model.optimizer.built)

    def build_optimizer(self) -> None:
        if not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)

    def optimizer_state(self) -> list[np.ndarray]:
        return [np.asarray(v.numpy()) for v in self.model.optimizer.variables]

    def optimizer_state_bytes(self) -> int:
        return sum(_variable_bytes(v) for v in self.model.optimizer.variables)

    def set_optimizer_state(self, state: list[np.ndarray], *, keep_learning_rate: bool = False) -> None:
        variables = self.model.optimizer.variables
        if len(variables) != len(state):
            return  # not built yet on this worker: it builds on the first step and adopts the state next round
        for v, s in zip(variables, state):
            if not (keep_learning_rate and v.name == LEARNING_RATE):
                v.assign(s)

    def set_learning_rate(self, value: float) -> None:
        rate = getattr(getattr(self.model, "optimizer", None), "learning_rate", None)
        if rate is not None and hasattr(rate, "assign"):
            rate.assign(value)

    def plain_learning_rate(self) -> bool:
        return hasattr(getattr(getattr(self.model, "optimizer", None), "_learning_rate", None), "assign")

    def learning_rate_schedule(self) -> Any | None:
        rate = getattr(getattr(self.model, "optimizer", None), "_learning_rate", None)
        if rate is None:
            return None
        import keras

        return rate if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) else None

    def overrides_train_step(self) -> bool:
        return user_defines(self.model, "train_step")

    def _rng_variables(self) -> list[Any]:
        """Variables that are neither weights nor optimizer state: random-generator states (dropout)."""
        weights = {id(w) for w in self.model.weights}
        return [v for v in self.model.variables if id(v) not in weights]

    def rng_state(self) -> list[np.ndarray]:
        return [np.asarray(v.numpy()) for v in self._rng_variables()]

    def set_rng_state(self, state: list[np.ndarray]) -> None:
        rng = self._rng_variables()
        if len(rng) == len(state):
            for v, s in zip(rng, state):
                v.assign(s)

    def keeps_keras_metrics(self) -> bool:
        return hasattr(self.model, "test_on_batch") and hasattr(self.model, "get_metrics_result")

    def predict_on_batch(self, x: Any) -> Any:
        return self.model.predict_on_batch(x)

    def restored_epoch(self) -> int | None:
        restored = getattr(self.model, "_initial_epoch", None)
        return int(restored) if restored else None

    def forget_restored_epoch(self) -> None:
        if hasattr(self.model, "_initial_epoch"):
            self.model._initial_epoch = None

    def clear_stop_training(self) -> None:
        if hasattr(self.model, "stop_training"):
            self.model.stop_training = False


class KerasOnTensorFlow(KerasAdapter):
    kind = "keras-tensorflow"


class KerasOnJax(KerasAdapter):
    kind = "keras-jax"


class KerasOnTorch(KerasAdapter):
    kind = "keras-torch"


class TorchModelAdapter(ModelAdapter):
    """A :class:`ddlf.models.TorchModel`: its module's parameters and its ``torch.optim`` optimizer."""

    kind = "torch"
    seeds_torch = True

    def trainable_variables(self) -> list[Any]:
        return [p for p in self.model.module.parameters() if p.requires_grad]

    def untrained_mask(self) -> list[bool]:
        return list(self.model.untrained_mask())

    def optimizer_built(self) -> bool:
        return bool(self.model.optimizer_built)

    def optimizer_state(self) -> list[np.ndarray]:
        return self.model.get_optimizer_state()

    def optimizer_layout(self) -> np.ndarray | None:
        return np.array(torch_optimizer.held(self.model.optimizer), dtype=bool)

    def conform_optimizer(self, layout: np.ndarray) -> None:
        torch_optimizer.conform(self.model.optimizer, self.model._torch, [bool(b) for b in layout])

    def optimizer_state_bytes(self) -> int:
        tensors = self.model._optimizer_tensors()
        if tensors is None:
            return 0
        held = len(torch_optimizer.params(self.model.optimizer))  # a bool each: which hold a state
        return held + sum(int(t.nbytes) for t in tensors)

    def set_optimizer_state(self, state: list[np.ndarray], *, keep_learning_rate: bool = False) -> None:
        # its parameter groups' rates are not among the state's arrays
        if not self.model.set_optimizer_state(state) and len(state):
            optimizer = type(self.model.optimizer).__name__
            warnings.warn(
                f"the optimizer's state ({len(state)} arrays) does not fit this model's {optimizer}: it starts "
                "afresh (create_model must build the same model and optimizer everywhere)",
                OptimizerStateWarning,
                stacklevel=3,
            )

    def rng_state(self) -> list[np.ndarray]:
        return self.model.get_rng_state()

    def set_rng_state(self, state: list[np.ndarray]) -> None:
        self.model.set_rng_state(state)


_ADAPTERS: weakref.WeakKeyDictionary[Any, ModelAdapter] = weakref.WeakKeyDictionary()


def user_defines(obj: Any, name: str) -> bool:
    """Whether ``obj``'s ``name`` is a user's own (the first class in its MRO to define it is not Keras's)."""
    for cls in type(obj).__mro__:
        if name in vars(cls):
            return not cls.__module__.startswith("keras.")
    return False


def adapter_for(model: Any) -> ModelAdapter:
    """``model``'s adapter, chosen once per model: a ``TorchModel``'s, or Keras' for the backend this process
    runs."""
    with contextlib.suppress(KeyError, TypeError):
        return _ADAPTERS[model]
    adapter = _choose(model)
    with contextlib.suppress(TypeError):  # a model that cannot be weakly referenced: chosen again next time
        _ADAPTERS[model] = adapter
    return adapter


def _choose(model: Any) -> ModelAdapter:
    from .torch_model import TorchModel

    if isinstance(model, TorchModel):
        return TorchModelAdapter(model)
    import keras

    backend = keras.backend.backend()
    chosen = {"tensorflow": KerasOnTensorFlow, "jax": KerasOnJax, "torch": KerasOnTorch}.get(backend)
    if chosen is None:
        raise ConfigError(f"ddlf does not train on the Keras backend {backend!r}")
    return chosen(model)


def _variable_bytes(v: Any) -> int:
    """A Keras variable's bytes: its array's own size where the backend's array says it without a copy (JAX,
    torch: a float64 variable on JAX without x64 holds float32), else its dtype's size times its shape."""
    n = getattr(getattr(v, "value", None), "nbytes", None)
    if isinstance(n, int):
        return n
    return np.dtype(v.dtype).itemsize * int(np.prod(tuple(v.shape)))
