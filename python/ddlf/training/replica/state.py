"""A model's state beyond its weights, for Keras models and ``TorchModel`` alike: its optimizer state and its
random generators' state (dropout), read and written as numpy arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import ModelMismatchError


def rng_variables(model: Any) -> list[Any]:
    """A Keras model's variables that are neither weights nor optimizer state: random-generator states (dropout)."""
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def optimizer_built(model: Any) -> bool:
    """Whether the model's optimizer has its state yet (Keras builds it on the first step)."""
    if hasattr(model, "get_optimizer_state"):
        return bool(model.optimizer_built)
    return bool(model.optimizer.built)


def rng_state(model: Any) -> list[np.ndarray]:
    """The model's random generators' state."""
    if hasattr(model, "get_rng_state"):
        return model.get_rng_state()
    return [np.asarray(v.numpy()) for v in rng_variables(model)]


def set_rng_state(model: Any, state: list[np.ndarray]) -> None:
    """Put back what :func:`rng_state` returned."""
    if hasattr(model, "set_rng_state"):
        model.set_rng_state(state)
        return
    rng = rng_variables(model)
    if len(rng) == len(state):
        for v, s in zip(rng, state):
            v.assign(s)


def set_learning_rate(model: Any, value: float) -> None:
    """Train with learning rate ``value`` from now on (a Keras optimizer with a plain rate; a schedule, or a model
    without one, is left as it is)."""
    rate = getattr(getattr(model, "optimizer", None), "learning_rate", None)
    if rate is not None and hasattr(rate, "assign"):
        rate.assign(value)


def take_round_rates(model: Any, stepper: Any, spec: Any) -> None:
    """What the master's optimizer says now, carried by a round (``spec``, a :class:`~..messages.RoundSpec`): its
    learning rate (Keras) or its parameter groups' hyperparameters (a ``TorchModel``: a torch scheduler, or the
    user, changed them on the master). ``stepper`` (None: none yet) scales the rate by the run's factor: it now
    multiplies the new rate."""
    if spec.learning_rate is not None:
        set_learning_rate(model, spec.learning_rate)  # after the state: a rate among the optimizer's variables
        if getattr(stepper, "base_lr", None) is not None:
            stepper.base_lr = spec.learning_rate  # the rate the linear scaling multiplies
    groups = getattr(spec, "optimizer_groups", None)
    if groups is not None:
        from ...frameworks.model_spec import set_optimizer_groups

        set_optimizer_groups(model, list(groups))
        if getattr(stepper, "base_lr", None) is not None:
            stepper.base_lr = [float(g["lr"]) for g in groups]


def optimizer_state(model: Any) -> list[np.ndarray]:
    """The optimizer's state arrays, in a fixed order."""
    if hasattr(model, "get_optimizer_state"):
        return model.get_optimizer_state()
    return [np.asarray(v.numpy()) for v in model.optimizer.variables]


def optimizer_state_bytes(model: Any) -> int:
    """The bytes of :func:`optimizer_state`, read off the optimizer's tensors or variables (no copy of the
    state, which a round's report would otherwise make of the whole optimizer each round)."""
    tensors = getattr(model, "_optimizer_tensors", None)  # a TorchModel: its optimizer's own tensors
    if tensors is not None:
        return sum(int(t.nbytes) for t in tensors() or [])
    return sum(_variable_bytes(v) for v in model.optimizer.variables)


def _variable_bytes(v: Any) -> int:
    """A Keras variable's bytes: its array's own size where the backend's array says it without a copy (JAX,
    torch: a float64 variable on JAX without x64 holds float32), else its dtype's size times its shape."""
    n = getattr(getattr(v, "value", None), "nbytes", None)
    if isinstance(n, int):
        return n
    return np.dtype(v.dtype).itemsize * int(np.prod(tuple(v.shape)))


LEARNING_RATE = "learning_rate"
"""The name of a Keras optimizer's learning-rate variable (a plain rate; a schedule has none)."""


def set_optimizer_state(model: Any, state: list[np.ndarray], *, keep_learning_rate: bool = False) -> None:
    """Put back what :func:`optimizer_state` returned. ``keep_learning_rate``: a Keras optimizer keeps its own
    rate (the state came from another process, whose rate may be scaled or set by a callback)."""
    if hasattr(model, "set_optimizer_state"):
        # An optimizer that has not stepped yet has no state to take: it adopts the averaged one next round.
        model.set_optimizer_state(state)
        return
    variables = model.optimizer.variables
    if len(variables) != len(state):
        return  # not built yet on this worker: it builds on the first step and adopts the state next round
    for v, s in zip(variables, state):
        if not (keep_learning_rate and v.name == LEARNING_RATE):
            v.assign(s)


def keras_metrics(model: Any) -> bool:
    """Whether ``model`` keeps Keras metrics (a loss tracker and compiled metrics with variables)."""
    return hasattr(model, "test_on_batch") and hasattr(model, "get_metrics_result")


def metric_state(model: Any) -> list[np.ndarray]:
    """A Keras model's metric state (every variable of its loss tracker and compiled metrics), in a fixed order.
    Every Keras built-in metric keeps a state that adds up over rows (a Mean's total and count, AUC's counts)."""
    return [np.asarray(v.numpy() if hasattr(v, "numpy") else v) for m in model.metrics for v in m.variables]


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
