"""Gradients reduced inside TensorFlow's step graph, while backward still runs (Horovod's design).

Keras on TensorFlow computes all of a batch's gradients in one ``tf.function`` call; handing them to Python as
numpy arrays, reducing them, converting them back and applying them in a second call costs several copies of
the model and a pause in which nothing computes. :class:`GraphBuckets` puts the reduction into the graph
instead: the trainable variables are cut, in reverse order (the order backward finishes them), into buckets of
about ``bucket_cap_mb``; each bucket's gradients are concatenated (the weight's slot, 1, as the last element) and
handed to the ring by a ``tf.numpy_function`` op, which weighs them by this worker's rows (only where a batch is
short) and averages them over the ranks where TensorFlow's buffer lies (the ring's mean scales the result as it
copies it out: with full batches on every rank nothing else touches the gradients). TensorFlow's executor runs
that op as soon as its gradients exist, so the ring reduces the last layers' gradients while the first layers'
are still being computed (the Rust ring releases the GIL), and the optimizer's step follows in the same graph:
one call per step, no gradient ever a numpy array in the interpreter's hands.

Reducing in place relies on ``tf.numpy_function`` handing Python a writable view of the tensor's own buffer
(TensorFlow does on CPU); :func:`_writes_through` checks that once per process, and each call checks that it got
a view, else it reduces a copy and the graph takes that back through a second ``numpy_function`` (one copy
more, the same result).

Every rank reduces the buckets in the same order: each bucket's op depends on the previous one's, so the ranks'
ring passes pair up whatever order the executor would pick. A bucket whose gradients are not finite is sent as
zeros with weight 0 (left out on every rank, as :mod:`.buckets` does on PyTorch); a step where no rank had a
row is not taken. A ring failure inside the graph is raised as itself (``ddlf.errors.CollectiveError``), not as
TensorFlow's wrapper, so the master redoes the round as it does for any failed reduction.

Used for models without their own ``train_step``, with float32 trainable weights, without ``jit_compile`` (an
XLA cluster cannot call Python) and without half precision on the wire (whose overflow check reads the averages
as arrays); the others exchange one buffer after the step's gradients.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .buckets import cut
from .tracing import AnyBatchSize

_WRITES_THROUGH: bool | None = None


def _writes_through(tf: Any) -> bool:
    """Whether ``tf.numpy_function`` hands a tensor to Python as a writable view of the tensor's own buffer, so
    that a reduction in place is what the graph reads after it (no copy back). Probed once per process, on a
    tensor made as the buckets are (a concatenation); where it does not hold, each bucket's result comes back
    through a second ``numpy_function`` (one copy more)."""
    global _WRITES_THROUGH
    if _WRITES_THROUGH is None:

        def bump(a: np.ndarray) -> np.ndarray:
            if a.flags.writeable and not a.flags.owndata:
                a += 1
            return np.float32(0)

        @tf.function(autograph=False)
        def probe(x: Any) -> Any:
            t = tf.concat([x, x], 0)
            done = tf.numpy_function(bump, [t], tf.float32, stateful=True)
            with tf.control_dependencies([done]):
                return tf.identity(t)

        _WRITES_THROUGH = bool(np.all(probe(tf.zeros([4096], tf.float32)).numpy() == 1))
    return _WRITES_THROUGH


class GraphBuckets:
    """The in-graph, bucketed gradient exchange of one Keras model on TensorFlow (see the module docs)."""

    op = "mean"
    """What the ring does with the buckets: the mean, scaled as the result is copied out."""

    def __init__(self, stepper: Any, cap_bytes: int) -> None:
        import tensorflow as tf  # type: ignore[import-untyped]

        self._tf = tf
        trainable = stepper.trainable
        self.sizes = [int(np.prod(tuple(v.shape))) for v in trainable]
        self.members = cut(self.sizes, cap_bytes)  # backward finishes the last layers first
        self.waited = 0.0
        """Seconds the last step spent inside the ring's reductions (overlapped with backward where it could)."""
        self._reduce: Callable[[np.ndarray], None] | None = None
        from ..messages import finite

        self._bad = False
        self._error: BaseException | None = None
        shapes = [tuple(v.shape) for v in trainable]

        in_place = _writes_through(tf)
        self._stash: dict[int, np.ndarray] = {}

        def reduce_bucket(flat: np.ndarray, weight: np.ndarray, key: np.ndarray) -> np.ndarray:
            """Reduce a bucket in place; 1 where that place is the tensor's own buffer (the graph reads the
            result there), 0 where it is a copy, which is kept for :func:`stashed`."""
            t0 = time.perf_counter()
            try:
                shared = in_place and flat.flags.writeable and not flat.flags.owndata
                if not shared:
                    flat = np.array(flat)
                w = np.float32(weight)
                if w == 0 or not finite(flat):
                    flat[:] = 0  # no batch, or left out of this bucket's average on every rank
                    self._bad = self._bad or w != 0
                elif w != 1:
                    flat *= w  # the weight's own element (1 in the graph) becomes w too
                assert self._reduce is not None
                self._reduce(flat)  # the mean over the ranks: the 1/n is applied as the result is copied out
                if not shared:
                    self._stash[int(key)] = flat
            except BaseException as exc:
                self._error = exc  # raised as itself by exchange(), not as TensorFlow's wrapper
                raise
            finally:
                self.waited += time.perf_counter() - t0
            return np.float32(1.0 if shared else 0.0)

        def stashed(key: np.ndarray) -> np.ndarray:
            return self._stash.pop(int(key))

        def exchanged(grads: list[Any], weight: Any) -> tuple[list[Any], Any]:
            out: list[Any] = [None] * len(grads)
            totals = []
            previous: list[Any] = []
            for k, m in enumerate(self.members):
                flat = tf.concat([tf.reshape(grads[i], [-1]) for i in m] + [tf.ones([1], tf.float32)], 0)
                key = tf.constant(k, tf.int32)
                with tf.control_dependencies(previous):  # every rank reduces the buckets in the same order
                    done = tf.numpy_function(reduce_bucket, [flat, weight, key], tf.float32, stateful=True)
                done.set_shape([])
                with tf.control_dependencies([done]):
                    # Reduced where it lies (read after the reduction: the control dependency), or the copy.
                    reduced = tf.cond(
                        done > 0,
                        lambda f=flat: tf.identity(f),
                        lambda key=key: tf.numpy_function(stashed, [key], tf.float32, stateful=True),
                    )
                reduced.set_shape(flat.shape)
                previous = [reduced]
                # mean(w_i g_i) / mean(w_i): with every rank's weight 1 (full batches) the mean is the result
                # already, and the division is skipped (it would multiply by exactly 1).
                total = reduced[-1]
                scale = tf.math.divide_no_nan(tf.constant(1.0, tf.float32), total)
                scaled = tf.cond(tf.equal(total, 1.0), lambda r=reduced: r, lambda r=reduced, s=scale: r * s)
                at = 0
                for i in m:
                    out[i] = tf.reshape(scaled[at : at + self.sizes[i]], shapes[i])
                    at += self.sizes[i]
                totals.append(total)
            return out, tf.stack(totals)

        optimizer = stepper.model.optimizer

        def applied(averaged: list[Any], totals: Any) -> Any:
            """The optimizer's step with the averages, in the same graph (no call back into Python between the
            reduction and the update); none where no rank had a row."""

            def step() -> Any:
                optimizer.apply_gradients(zip(averaged, trainable))
                return tf.constant(True)

            return tf.cond(tf.reduce_max(totals) > 0, step, lambda: tf.constant(False))

        @tf.function(reduce_retracing=True, autograph=False)
        def with_batch(x: Any, y: Any, sw: Any, weight: Any) -> Any:
            averaged, totals = exchanged(stepper.graph_gradients(x, y, sw), weight)
            return applied(averaged, totals), totals

        @tf.function(autograph=False)
        def without_batch() -> Any:
            averaged, totals = exchanged([tf.zeros_like(v) for v in trainable], tf.constant(0.0, tf.float32))
            return applied(averaged, totals), totals

        self._with, self._without = AnyBatchSize(tf, with_batch), without_batch  # one trace for short batches too
        self._stepper = stepper

    @staticmethod
    def supports(model: Any, trainable: list[Any]) -> bool:
        """Float32 trainable weights and no XLA (the stepper checks that the model has Keras's own
        ``train_step``)."""
        return (
            bool(trainable)
            and not getattr(model, "jit_compile", False)
            and all(np.dtype(v.dtype) == np.float32 for v in trainable)
        )

    def close(self) -> None:
        """Nothing to release (the hooks of :class:`~.buckets.Buckets` have no counterpart here)."""

    def exchange(
        self,
        backward: Callable[[], None] | None,
        weight: float,
        reduce: Callable[[np.ndarray], None],
    ) -> tuple[None, list[float], bool]:
        """As :meth:`.buckets.Buckets.exchange`, but ``reduce`` averages (a mean over the ranks, in place), and
        the optimizer's step is taken here, in the same graph: ``backward`` hands this step's batch to the
        stepper (:meth:`~.steppers.Stepper.backward`), or is ``None`` (no batch: zeros with weight 0). Returns
        ``None`` where :meth:`.buckets.Buckets.exchange` returns the averages (applied already), each bucket's
        mean weight over the ranks (0: no rank sent any; then no step was taken), and whether a bucket of this
        rank's was left out as not finite."""
        tf = self._tf
        self._reduce, self._bad, self._error, self.waited = reduce, False, None, 0.0
        try:
            if backward is None:
                self._stepper.build_optimizer()  # its slots exist before the graph that steps it is traced
                _, totals = self._without()
            else:
                backward()
                x, y, sw = self._stepper.take_batch()
                _, totals = self._with(x, y, sw, tf.constant(weight, tf.float32))
            totals = [float(t) for t in totals.numpy()]
        except Exception:
            if self._error is not None:
                raise self._error from None
            raise
        finally:
            self._reduce = None
        return None, totals, self._bad
