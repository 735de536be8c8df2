"""Keras on TensorFlow: two ``tf.function``\\ s traced once per run (gradients; ``apply_gradients``), and model
averaging's whole steps :data:`~.grouped.GROUP_STEPS` to a call."""

from __future__ import annotations

from typing import Any

import numpy as np

from ....errors import InvalidStateError
from ....frameworks.adapter import adapter_for
from ..tracing import AnyBatchSize
from .grouped import _Grouped
from .keras import _CatchApply, _KerasStepper


class _TensorFlowStepper(_KerasStepper):
    def __init__(self, model: Any) -> None:
        super().__init__(model)
        import tensorflow as tf  # type: ignore[import-untyped]

        self._tf = tf
        trainable = self.trainable
        jit = bool(getattr(model, "jit_compile", False))

        @tf.function(reduce_retracing=True, jit_compile=jit, autograph=False)
        def gradients(x: Any, y: Any, sw: Any) -> Any:
            return self.graph_gradients(x, y, sw)

        @tf.function(reduce_retracing=True, jit_compile=jit, autograph=False)
        def apply(grads: Any) -> None:
            model.optimizer.apply_gradients(zip(grads, trainable))

        @tf.function(reduce_retracing=True, jit_compile=jit, autograph=False)
        def step(x: Any, y: Any, sw: Any) -> None:
            model.train_step((x, y) if sw is None else (x, y, sw))

        @tf.function(reduce_retracing=True, jit_compile=jit, autograph=False)
        def steps(xs: Any, ys: Any, n: Any) -> None:
            def body(i: Any) -> Any:
                model.train_step((xs[i], ys[i]))
                return (i + 1,)

            # one step after another (each reads the weights the previous one wrote)
            tf.while_loop(lambda i: i < n, body, (tf.constant(0, tf.int32),), parallel_iterations=1)

        # Each traced once for batches of any size (the epoch's last, short one too): tracing.py
        self._gradients: Any = AnyBatchSize(tf, gradients)
        self._apply = apply
        self._one_step = AnyBatchSize(tf, step)  # a batch...
        self._grouped_steps = AnyBatchSize(tf, steps, leading=2)  # ...and a stack of them (model averaging, async)
        if adapter_for(model).overrides_train_step():
            # The model's own train_step computes the gradients; the optimizer's apply is caught (not run) and
            # the averaged gradients are applied to the variables it was given.
            @tf.function(reduce_retracing=True, jit_compile=jit, autograph=False)
            def caught(x: Any, y: Any, sw: Any) -> Any:
                with _CatchApply(model.optimizer) as catch:
                    model.train_step((x, y) if sw is None else (x, y, sw))
                self.trainable = catch.variables
                return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in catch.pairs]

            @tf.function(reduce_retracing=True, jit_compile=jit, autograph=False)
            def apply_caught(grads: Any) -> None:
                model.optimizer.apply(grads, self.trainable)

            self._gradients, self._apply = AnyBatchSize(tf, caught), apply_caught
        # n as a tensor: a Python int would trace the loop again for each count
        self._grouped = _Grouped(
            self._one_step, lambda xs, ys, n: self._grouped_steps(xs, ys, tf.constant(n, tf.int32))
        )
        self._built = False
        self._batch: tuple[Any, Any, Any] | None = None
        self._graph_buckets: tuple[int, Any] | None = None

    def graph_gradients(self, x: Any, y: Any, sw: Any) -> list[Any]:
        """Inside a ``tf.function``: this batch's gradients (Keras's ``train_step`` up to the optimizer), the
        model's loss tracker and metrics updated."""
        tf, model, trainable = self._tf, self.model, self.trainable
        with tf.GradientTape() as tape:
            y_pred = self._forward(x)
            loss = self._loss(x, y, y_pred, sw)
            model._loss_tracker.update_state(loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
            loss = model.optimizer.scale_loss(loss)
        grads = tape.gradient(loss, trainable)
        model.compute_metrics(x, y, y_pred, sample_weight=sw)
        return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, trainable)]

    def buckets(self, cap_bytes: int, wire: str | None = None) -> Any:
        """A :class:`~.graph_buckets.GraphBuckets` (the reduction inside the step's graph), or ``None`` for a
        model it does not support or with half precision on the wire (whose overflow check reads the averages
        as arrays)."""
        from ..graph_buckets import GraphBuckets

        if wire is not None or adapter_for(self.model).overrides_train_step():
            return None  # its own train_step computes its gradients (caught at its optimizer's apply)
        if not GraphBuckets.supports(self.model, self.trainable):
            return None
        if self._graph_buckets is None or self._graph_buckets[0] != cap_bytes:
            self._graph_buckets = (cap_bytes, GraphBuckets(self, cap_bytes))
        return self._graph_buckets[1]

    def backward(self, x: Any, y: Any, sw: Any = None) -> None:
        """Hold the batch for :meth:`take_batch`: the in-graph exchange computes its gradients."""
        self._ready(x, y, sw)
        self._flush()
        self._batch = (x, y, sw)

    def take_batch(self) -> tuple[Any, Any, Any]:
        """The batch :meth:`backward` was given."""
        batch, self._batch = self._batch, None
        if batch is None:
            raise InvalidStateError("take_batch() without a batch: backward() first")
        return batch

    def _ready(self, x: Any, y: Any, sw: Any = None) -> None:
        if not self._built:
            self._build(x, y, sw)
            self._built = True

    def step(self, x: Any, y: Any, sw: Any = None) -> None:
        self._ready(x, y, sw)
        self._grouped.add(x, y, sw)

    def _flush(self) -> None:
        self._grouped.flush()

    def gradients(self, x: Any, y: Any, sw: Any = None) -> list[np.ndarray]:
        self._ready(x, y, sw)
        self._flush()
        return [np.asarray(g.numpy()) for g in self._gradients(x, y, sw)]  # 0-d gradients as 0-d arrays

    def apply(self, gradients: list[np.ndarray]) -> None:
        self._flush()
        self._apply([self._tf.convert_to_tensor(g) for g in gradients])
