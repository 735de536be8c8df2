"""What the Keras steppers share (every backend), and catching a custom ``train_step``'s ``apply``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ....errors import ConfigError
from .base import Stepper


class _KerasStepper(Stepper):
    def __init__(self, model: Any) -> None:
        if getattr(model, "optimizer", None) is None:
            raise ConfigError("ddlf trains a compiled model: create_model must compile it (model.compile(...))")
        self.model = model
        self.trainable = list(model.trainable_weights)
        if not self.trainable:
            raise ConfigError(
                "the model has no trainable weights: every layer is frozen (trainable=False), so there is nothing "
                "to train"
            )
        self.base_lr: float | None = None

    def _flush(self) -> None:
        """Run the whole steps gathered so far (TensorFlow) before anything else reads or changes the model's
        state."""

    def _loss(self, x: Any, y: Any, y_pred: Any, sw: Any = None) -> Any:
        model = self.model
        compute = getattr(model, "_compute_loss", None) or model.compute_loss
        return compute(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=True)

    def _build(self, x: Any, y: Any, sw: Any = None) -> None:
        """Build what Keras builds on a model's first batch (its compiled metrics and loss), and the optimizer."""
        if x is not None:
            self.model._symbolic_build(data_batch=(x, y, sw))
        if not self.sharded:
            self.build_optimizer()

    def _forward(self, x: Any) -> Any:
        model = self.model
        return model(x, training=True) if getattr(model, "_call_has_training_arg", True) else model(x)

    def start(self, weights: list[np.ndarray]) -> None:
        """Begin a round from ``weights`` (in ``model.get_weights()`` order) with the model's metrics reset: what
        ``model.set_weights``, ``model.reset_metrics`` and :meth:`begin` do in turn (a stepper that holds the
        model's state during a round may do it without writing every variable)."""
        self.model.set_weights(weights)
        self.model.reset_metrics()
        self.begin()

    def weights(self) -> list[np.ndarray]:
        """After :meth:`end`: the model's weights, as ``model.get_weights()`` gives them (arrays, 0-d included)."""
        return [np.asarray(w) for w in self.model.get_weights()]

    def zeros(self) -> list[np.ndarray]:
        return [np.zeros(tuple(v.shape), dtype=np.dtype(v.dtype)) for v in self.trainable]

    def set_trainable(self, values: list[np.ndarray]) -> None:
        self._flush()
        for v, a in zip(self.trainable, values):
            v.assign(a)

    def build_optimizer(self) -> None:
        if not self.model.optimizer.built:
            self.model.optimizer.build(self.trainable)

    def finish(self) -> None:
        self._flush()  # the metrics' results are not read: on JAX they are small compiled functions of their own

    def end(self) -> dict[str, float]:
        self._flush()
        if not all(getattr(m, "built", True) for m in self.model.metrics):
            return {}  # no batch here yet (fewer rows than workers): Keras builds compiled metrics on the first
        return {k: float(v) for k, v in self.model.get_metrics_result().items()}

    def set_learning_rate_factor(self, factor: float) -> None:
        self._flush()
        optimizer = self.model.optimizer
        from . import check_scalable

        check_scalable(self.model)
        if self.base_lr is None:
            self.base_lr = float(np.asarray(optimizer.learning_rate))
        optimizer.learning_rate = self.base_lr * factor


class _CatchApply:
    """While open, the optimizer's ``apply`` (which ``apply_gradients`` calls too) records the gradients and
    variables a custom ``train_step`` hands it, and applies nothing: the gradients are averaged first."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.pairs: list[tuple[Any, Any]] = []

    @property
    def variables(self) -> list[Any]:
        return [v for _, v in self.pairs]

    def __enter__(self) -> _CatchApply:
        def catch(grads: Any, trainable_variables: Any = None) -> None:
            if self.pairs:
                raise ConfigError(
                    "GradientAveraging: this train_step applies gradients more than once per batch (several "
                    "optimizers, a GAN's two steps); train it with ModelAveraging or Asynchronous"
                )
            self.pairs = list(zip(grads, trainable_variables))

        self.optimizer.apply = catch  # an instance attribute: found before the class's method
        return self

    def __exit__(self, *exc: object) -> None:
        del self.optimizer.apply
        if exc[0] is None and not self.pairs:
            raise ConfigError("GradientAveraging: this train_step applied no gradients (it calls no optimizer)")
