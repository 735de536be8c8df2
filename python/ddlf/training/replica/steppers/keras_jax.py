"""Keras on JAX: two jitted, stateless functions over the model's state, written back at the end of each round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ....frameworks.adapter import user_defines
from .keras import _KerasStepper


@dataclass(frozen=True)
class _Layout:
    """What :meth:`_JaxStepper.start` needs to begin a round without writing the model's variables: the variables
    the state was read from (``variables``: each group's, then ``model.weights``; the layout holds while they are
    the same objects), where each of ``model.weights`` sits in the state (``slots``: group and index), and the
    metrics' state just after ``reset_metrics`` (``metric_zeros``: JAX arrays are immutable, so every round can
    start from the same ones)."""

    variables: tuple[tuple[Any, ...], ...]
    slots: tuple[tuple[int, int], ...]
    metric_zeros: tuple[Any, ...]

    def holds(self, groups: list[list[Any]], weights: list[Any]) -> bool:
        """Whether ``groups`` and ``weights`` are still the variables this layout was read from."""
        now = (*groups, weights)
        return len(now) == len(self.variables) and all(
            len(a) == len(b) and all(x is y for x, y in zip(a, b)) for a, b in zip(now, self.variables)
        )


def _logs_are_metrics(model: Any) -> bool:
    """Whether the logs of Keras's own ``train_step`` are the model's metric results (``get_metrics_result``):
    neither ``train_step`` nor ``compute_metrics`` is the user's."""
    return not any(user_defines(model, name) for name in ("train_step", "compute_metrics"))


class _JaxStepper(_KerasStepper):
    """Keras's JAX trainer keeps the model's state as arrays during ``fit`` and writes it back at the end; this
    does the same for a round."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        import jax

        self._jax = jax

        def gradients(tv: Any, ntv: Any, mv: Any, ov: Any, x: Any, y: Any, sw: Any) -> Any:
            grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
            (_loss, aux), grads = grad_fn(tv, ntv, mv, x, y, sw, training=True, optimizer_variables=ov)
            unscaled, y_pred, ntv, mv = aux
            _logs, mv = model._update_metrics_variables(mv, unscaled, x, y, y_pred, sw)
            return grads, ntv, mv

        def apply(ov: Any, grads: Any, tv: Any) -> Any:
            return model.optimizer.stateless_apply(ov, grads, tv)

        logs_are_metrics = _logs_are_metrics(model)

        def step(tv: Any, ntv: Any, mv: Any, ov: Any, x: Any, y: Any, sw: Any) -> Any:
            logs, (tv, ntv, ov, mv) = model.train_step((tv, ntv, ov, mv), (x, y) if sw is None else (x, y, sw))
            # A user's train_step's logs stay inside (the round's logs are then read with get_metrics_result).
            return tv, ntv, mv, ov, logs if logs_are_metrics else None

        self._gradients = jax.jit(gradients)
        self._apply = jax.jit(apply)
        self._step = jax.jit(step)
        self._state: list[list[Any]] | None = None
        self._open = False
        self._logs: Any = None
        """The last whole step's logs (Keras's ``train_step`` returns the metric results), None after gradients."""
        self._logs_are_metrics = logs_are_metrics
        self._layout: _Layout | None = None
        self._capture = False
        # A model that brings its own set_weights, reset_metrics or get_weights has them called: every round
        # goes through Keras.
        self._in_state = not any(user_defines(model, n) for n in ("set_weights", "reset_metrics", "get_weights"))

    def _variables(self) -> list[list[Any]]:
        m = self.model
        return [m.trainable_variables, m.non_trainable_variables, m.metrics_variables, m.optimizer.variables]

    def begin(self) -> None:
        self._open = True  # the state is read at the first batch (Keras builds its metrics on it)
        self._logs = None
        self._capture = False

    def start(self, weights: list[np.ndarray]) -> None:
        """Begin a round from ``weights`` into the round's state, not the variables: read every variable as it is
        (a learning rate or a state set since the last round counts), put ``weights`` and the metrics' reset state
        in their places. Writing each weight and resetting each metric through Keras cost 0.5 ms of a 2-batch
        asynchronous chunk of a 100k-parameter MLP (a batch's step: 0.3 ms). The first round (or one after the
        model's variables changed: a recompile, a new layer, a layer frozen) goes through Keras and learns the
        layout; so does every round of a model with its own ``set_weights``, ``reset_metrics`` or ``get_weights``,
        or a metric with its own ``reset_state``."""
        layout = self._layout
        if layout is None or self._state is not None or len(weights) != len(layout.slots):
            return self._start_through_keras(weights)
        groups = self._variables()
        if not layout.holds(groups, self.model.weights):
            return self._start_through_keras(weights)
        state = [[v.value for v in group] for group in groups]
        values = []
        for (g, i), w in zip(layout.slots, weights):
            held = state[g][i]
            if np.shape(w) != held.shape:
                return self._start_through_keras(weights)  # Keras's own error names the weight
            # A copy: the caller's buffer may be reused, and JAX on CPU takes an aligned numpy array's memory as
            # its own (device_put's may_alias=False does not copy one).
            values.append(np.array(w, dtype=held.dtype))
        for (g, i), value in zip(layout.slots, self._jax.device_put(values)):
            state[g][i] = value
        state[2] = list(layout.metric_zeros)
        self.begin()
        self._state = state

    def _start_through_keras(self, weights: list[np.ndarray]) -> None:
        self._write_back()  # a round left open (none should be: end() runs in a finally) ends first
        self._layout = None
        # Copies, as in start(): Keras's set_weights hands JAX an aligned array's memory as the variable's.
        super().start([np.array(w) for w in weights])
        self._capture = self._in_state  # the first batch reads the state: learn the layout from it

    def _ready(self, x: Any, y: Any, sw: Any = None) -> list[list[Any]]:
        if self._state is None:
            assert self._open, "begin() first"
            self._build(x, y, sw)
            groups = self._variables()
            self._state = [[v.value for v in group] for group in groups]
            if self._capture:
                self._capture = False
                self._layout = _layout(groups, self.model.weights, self._state[2], self.model.metrics)
        return self._state

    def step(self, x: Any, y: Any, sw: Any = None) -> None:
        state = self._ready(x, y, sw)
        *groups, self._logs = self._step(*state, x, y, sw)
        self._state = [list(group) for group in groups]

    def gradients(self, x: Any, y: Any, sw: Any = None) -> list[np.ndarray]:
        self._logs = None  # the round's logs are the metrics' results (a gradient step returns none)
        tv, ntv, mv, ov = state = self._ready(x, y, sw)
        grads, ntv, mv = self._gradients(tv, ntv, mv, ov, x, y, sw)
        state[1], state[2] = ntv, mv
        return [np.asarray(g) for g in grads]

    def apply(self, gradients: list[np.ndarray]) -> None:
        tv, _ntv, _mv, ov = state = self._ready(None, None)  # None: no batch here yet this round
        tv, ov = self._apply(ov, gradients, tv)
        state[0], state[3] = list(tv), list(ov)

    def set_trainable(self, values: list[np.ndarray]) -> None:
        # Copies: the caller reuses its buffer, and JAX takes a numpy array's memory as its own where it is
        # 64-byte aligned (a variable assigned a view would change when the buffer is written next).
        if self._state is None:
            super().set_trainable([np.array(a) for a in values])
            return
        self._state[0] = [self._jax.numpy.array(a) for a in values]

    def _write_back(self) -> None:
        if self._state is not None:
            for group, values in zip(self._variables(), self._state):
                for v, value in zip(group, values):
                    if v.value is not value:
                        v.assign(value)
            self._state = None
        self._open = False

    def finish(self) -> None:
        self._logs = None
        self._write_back()
        super().finish()

    def end(self) -> dict[str, float]:
        logs, self._logs = self._logs, None
        self._write_back()
        if logs is not None and self._logs_are_metrics:
            # The last step's logs are get_metrics_result() after it, computed in the step (as fit reads them).
            return {k: float(v) for k, v in self._jax.device_get(logs).items()}
        return super().end()

    def weights(self) -> list[np.ndarray]:
        if not self._in_state:
            return super().weights()
        return [np.asarray(v.value) for v in self.model.weights]  # no copy: a JAX array does not change

    def set_learning_rate_factor(self, factor: float) -> None:
        super().set_learning_rate_factor(factor)
        if self._state is not None:  # the learning rate is one of the optimizer's variables: update its copy
            optimizer = self.model.optimizer
            for i, v in enumerate(optimizer.variables):
                if v is optimizer._learning_rate:
                    self._state[3][i] = v.value


def _layout(groups: list[list[Any]], weights: list[Any], metric_state: list[Any], metrics: list[Any]) -> _Layout | None:
    """The :class:`_Layout` of a state read from ``groups`` (None where it cannot be kept: see below)."""
    where = {id(v): (g, i) for g, group in enumerate(groups) for i, v in enumerate(group)}
    slots = [where.get(id(w)) for w in weights]
    if any(s is None for s in slots) or any(getattr(w, "_layout", None) is not None for w in weights):
        return None  # a weight outside the state, or one laid out across devices (keras.distribution)
    if any(user_defines(m, "reset_state") for m in metrics):
        return None  # a metric that resets itself its own way: reset through Keras every round
    variables = (*(tuple(group) for group in groups), tuple(weights))
    return _Layout(variables, tuple(s for s in slots if s is not None), tuple(metric_state))
