"""A model's state beyond its weights, for every framework alike: its optimizer state, its random generators'
state (dropout), its learning rate and its Keras metrics, read and written as numpy arrays through the model's
adapter (:mod:`ddlf.frameworks.adapter`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import ModelMismatchError
from ...frameworks.adapter import LEARNING_RATE, adapter_for

__all__ = [
    "LEARNING_RATE",
    "MetricSum",
    "keras_metrics",
    "metric_results",
    "metric_state",
    "optimizer_built",
    "optimizer_state",
    "optimizer_state_bytes",
    "rng_state",
    "set_optimizer_state",
    "set_rng_state",
    "take_round_rates",
]


def optimizer_built(model: Any) -> bool:
    """Whether the model's optimizer has its state yet (Keras builds it on the first step)."""
    return adapter_for(model).optimizer_built()


def rng_state(model: Any) -> list[np.ndarray]:
    """The model's random generators' state."""
    return adapter_for(model).rng_state()


def set_rng_state(model: Any, state: list[np.ndarray]) -> None:
    """Put back what :func:`rng_state` returned."""
    adapter_for(model).set_rng_state(state)


def optimizer_state(model: Any) -> list[np.ndarray]:
    """The optimizer's state arrays, in a fixed order."""
    return adapter_for(model).optimizer_state()


def optimizer_state_bytes(model: Any) -> int:
    """The bytes of :func:`optimizer_state`, read off the optimizer's tensors or variables (no copy of the
    state, which a round's report would otherwise make of the whole optimizer each round)."""
    return adapter_for(model).optimizer_state_bytes()


def set_optimizer_state(model: Any, state: list[np.ndarray], *, keep_learning_rate: bool = False) -> None:
    """Put back what :func:`optimizer_state` returned. ``keep_learning_rate``: a Keras optimizer keeps its own
    rate (the state came from another process, whose rate may be scaled or set by a callback)."""
    adapter_for(model).set_optimizer_state(state, keep_learning_rate=keep_learning_rate)


def take_round_rates(model: Any, stepper: Any, spec: Any) -> None:
    """What the master's optimizer says now, carried by a round (``spec``, a :class:`~..messages.RoundSpec`): its
    learning rate (Keras) or its parameter groups' hyperparameters (a ``TorchModel``: a torch scheduler, or the
    user, changed them on the master). ``stepper`` (None: none yet) scales the rate by the run's factor: it now
    multiplies the new rate."""
    if spec.learning_rate is not None:
        adapter_for(model).set_learning_rate(spec.learning_rate)  # after the state: a rate among its variables
        if stepper is not None and stepper.base_lr is not None:
            stepper.base_lr = spec.learning_rate  # the rate the linear scaling multiplies
    groups = getattr(spec, "optimizer_groups", None)
    if groups is not None:
        from ...frameworks.torch_spec import set_optimizer_groups

        set_optimizer_groups(model, list(groups))
        if stepper is not None and stepper.base_lr is not None:
            stepper.base_lr = [float(g["lr"]) for g in groups]


def keras_metrics(model: Any) -> bool:
    """Whether ``model`` keeps Keras metrics (a loss tracker and compiled metrics with variables)."""
    return adapter_for(model).keeps_keras_metrics()


def metric_state(model: Any) -> list[np.ndarray]:
    """A Keras model's metric state (every variable of its loss tracker and compiled metrics), in a fixed order.
    Every Keras built-in metric keeps a state that adds up over rows (a Mean's total and count, AUC's counts)."""
    return [np.asarray(v.numpy()) for m in model.metrics for v in m.variables]


def metric_results(model: Any, state: list[np.ndarray]) -> dict[str, float]:
    """The results of ``model``'s metrics for ``state`` (what :func:`metric_state` gave, or several added up)."""
    variables = [v for m in model.metrics for v in m.variables]
    if len(variables) != len(state):
        raise ModelMismatchError(
            f"metric state of {len(state)} arrays for a model with {len(variables)} metric variables"
        )
    for v, s in zip(variables, state):
        v.assign(np.asarray(s, dtype=np.dtype(v.dtype)))
    return {k: float(v) for k, v in model.get_metrics_result().items()}


class MetricSum:
    """Adds up a Keras model's metric state batch by batch, where each call (``train_on_batch``,
    ``test_on_batch``) starts from reset metrics: the sum is the state of the whole run of batches."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.state: list[np.ndarray] | None = None

    def begin(self) -> None:
        """A batch is about to be stepped or evaluated: its state alone is what :meth:`add` reads (whatever the
        Keras version's ``*_on_batch`` does with the metrics)."""
        self.model.reset_metrics()

    def add(self) -> None:
        """Count the batch just stepped or evaluated."""
        batch = metric_state(self.model)
        self.state = batch if self.state is None else [a + b for a, b in zip(self.state, batch)]

    def results(self) -> dict[str, float]:
        """The metrics over every batch counted (empty before the first)."""
        return metric_results(self.model, self.state) if self.state is not None else {}
