"""Keras on JAX: two jitted, stateless functions over the model's state, written back at the end of each round."""

from __future__ import annotations

from typing import Any

import numpy as np

from .keras import _KerasStepper


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

        def step(tv: Any, ntv: Any, mv: Any, ov: Any, x: Any, y: Any, sw: Any) -> Any:
            _logs, (tv, ntv, ov, mv) = model.train_step((tv, ntv, ov, mv), (x, y) if sw is None else (x, y, sw))
            return tv, ntv, mv, ov

        self._gradients = jax.jit(gradients)
        self._apply = jax.jit(apply)
        self._step = jax.jit(step)
        self._state: list[list[Any]] | None = None
        self._open = False

    def _variables(self) -> list[list[Any]]:
        m = self.model
        return [m.trainable_variables, m.non_trainable_variables, m.metrics_variables, m.optimizer.variables]

    def begin(self) -> None:
        self._open = True  # the state is read at the first batch (Keras builds its metrics on it)

    def _ready(self, x: Any, y: Any, sw: Any = None) -> list[list[Any]]:
        if self._state is None:
            assert self._open, "begin() first"
            self._build(x, y, sw)
            self._state = [[v.value for v in group] for group in self._variables()]
        return self._state

    def step(self, x: Any, y: Any, sw: Any = None) -> None:
        state = self._ready(x, y, sw)
        self._state = [list(group) for group in self._step(*state, x, y, sw)]

    def gradients(self, x: Any, y: Any, sw: Any = None) -> list[np.ndarray]:
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
                    v.assign(value)
            self._state = None
        self._open = False

    def finish(self) -> None:
        self._write_back()
        super().finish()

    def end(self) -> dict[str, float]:
        self._write_back()
        return super().end()

    def set_learning_rate_factor(self, factor: float) -> None:
        super().set_learning_rate_factor(factor)
        if self._state is not None:  # the learning rate is one of the optimizer's variables: update its copy
            optimizer = self.model.optimizer
            for i, v in enumerate(optimizer.variables):
                if v is optimizer._learning_rate:
                    self._state[3][i] = v.value
