"""Gradients reduced inside TensorFlow's step graph, while backward still runs (Horovod's design).

Keras on TensorFlow computes all of a batch's gradients in one ``tf.function`` call; handing them to Python as
numpy arrays, reducing them, converting them back and applying them in a second call costs several copies of
the model and a pause in which nothing computes. :class:`GraphBuckets` puts the reduction into the graph
instead: the trainable variables are cut, in reverse order (the order backward finishes them), into buckets of
about ``bucket_cap_mb``; each bucket's gradients go to a ``tf.numpy_function`` op as they are (TensorFlow hands
Python its own buffers: no concatenation), which has the ring average them over the ranks, with one more element
holding this worker's weight (its rows over the batch size), out of place: the ring reads the gradients and
writes the means into output arrays, 64-byte aligned so that TensorFlow takes them as its tensors without a
copy, and the optimizer reads them there. Where one host holds every rank (the ring's ``shares``), the
optimizer is one of Keras's own and the model has at most :data:`SHARED_BUCKETS` buckets, there are no output
arrays: the means stay where the host's shared memory holds them (read-only) and TensorFlow reads them there
(each gradient sent with a gap of zeros after it, so that every view starts on a cache line; each bucket its own
tag, so its region is rewritten only by its next reduction, which no rank starts before every rank has entered
it). So a gradient is read once into shared memory (besides the finiteness check) and nothing is copied out;
between hosts the mean goes once into its output array, and a flat ring (one rank per host) sends each gradient
from where it lies and writes the means straight into the output arrays. The ring's mean scales the result as it
writes it (on one host as it sums), so with full batches on every rank nothing else touches the gradients.
The optimizer's step follows in the same graph: one call per step, no gradient ever copied in the interpreter's
hands.

Overlap with backward needs a second thread in TensorFlow's inter-op pool. A bucket's op holds the thread that
runs it until its ring pass ends (the Rust ring releases the GIL, not the thread). With two or more threads
(TensorFlow's default is one per core, as on a ``ddlf-worker`` started without ``--threads``), the executor runs
the op as soon as its gradients exist, and the ring reduces the last layers' gradients while the first layers'
are still being computed. With one (``--threads 1``, which ``Cluster.local`` gives each worker when there are
fewer than two cores per worker, and Slurm with one CPU a task), the executor finishes backward first and the buckets
follow it one by one. Measured on 2 cores (2026-11-27, the wide MLP; numbers in issue 38's notes):
- two network-namespace hosts at 1 Gbit/s, 4 MB buckets with two inter-op threads: bucket 0 (16.9 MB) went to
  the ring ~20 ms into the step instead of ~27, but the rounds were no faster (median 1.222 s against 1.222 s
  over three alternations). The second ring call and the other host's share of the two cores took back what
  the overlap hid;
- loopback: a second inter-op thread made model averaging ~4% slower, with both workers' threads on two
  cores.
So the budget stays one inter-op thread per ``--threads``: overlap pays where a host's cores are its own.

Nothing the graph computes is written in place: the gradients are only read, and a short batch's weighted
gradients are copies. For Keras's own optimizers the output arrays are kept and written again at the next step,
after the step that read them ended: a tensor TensorFlow made from them does not own its memory, so no kernel
writes into it in place, and these optimizers assign their state computed values, never a gradient as it is
(which would make the state variable share the array; a test checks every one). Any other optimizer gets fresh
output arrays at each step, which TensorFlow keeps alive for as long as it holds them.

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
from typing import Any, Protocol

import numpy as np

from .buckets import cut
from .tracing import AnyBatchSize

ALIGN = 64
"""Bytes an output array's address is a multiple of: TensorFlow's CPU alignment (``EIGEN_MAX_ALIGN_BYTES``), below
which it copies a ``numpy_function``'s result instead of taking its memory."""


class Ring(Protocol):
    """The reductions the buckets make (:class:`ddlf.worker.reduction.BucketRing` on a worker)."""

    shares: bool
    """Whether :meth:`shared` works (one host holds every rank)."""

    def into(self, parts: list[np.ndarray], out: list[np.ndarray]) -> None:
        """The mean over the ranks of ``parts``' concatenation (only read), written into ``out``'s arrays."""

    def shared(self, parts: list[np.ndarray], tag: int) -> np.ndarray:
        """The same mean as a flat array where the host's shared memory holds it (cache-line aligned,
        read-only), rewritten only by the next call with the same ``tag``."""


SHARED_BUCKETS = 3
"""The most buckets whose means are read in shared memory: a host's node keeps 4 shared-memory files
(``KEEP_SEGMENTS`` in ``rust/ddlf-collective/src/node/mod.rs``), one left for the calls that are not a bucket's."""


def aligned(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array of ``shape`` whose memory starts at a multiple of :data:`ALIGN` bytes."""
    n = int(np.prod(shape, dtype=np.int64))
    raw = np.empty(n * 4 + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + n * 4].view(np.float32).reshape(shape)


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
        """Seconds the last step spent inside the ring's reductions (overlapped with backward where the inter-op
        pool has a second thread, see the module docs)."""
        self._ring: Ring | None = None
        from ..messages import finite

        self._bad = False
        self._error: BaseException | None = None
        shapes = [tuple(v.shape) for v in trainable]
        optimizer = stepper.model.optimizer
        # Each bucket's results (its gradients' means, then the weights' mean), written by the ring at every step:
        # kept for Keras's own optimizers (see the module docs), made afresh each step for any other.
        self._keeps = type(optimizer).__module__.split(".")[0] == "keras"
        # (Made at a bucket's first reduction into arrays: none where every result is read in shared memory.)
        self._shapes = [[shapes[i] for i in m] + [(1,)] for m in self.members]
        self._out: list[list[np.ndarray] | None] = [None] * len(self.members)
        # What a bucket sends with no batch or non-finite gradients: views of one array of zeros (only read).
        zero = np.zeros(max(self.sizes), np.float32)
        self._zeros = [[zero[: self.sizes[i]].reshape(shapes[i]) for i in m] + [zero[:1]] for m in self.members]
        one = np.ones(1, np.float32)
        # Where the result can stay in the host's shared memory (``exchange``'s ``share``): each gradient at an
        # offset of a multiple of ALIGN bytes (the region starts on one), so TensorFlow takes every view without
        # a copy; the gaps are zeros on every rank, so they sum to zeros.
        step = ALIGN // 4
        gap = np.zeros(step, np.float32)
        self._gaps: list[list[np.ndarray]] = []
        self._at: list[list[int]] = []
        for m in self.members:
            at, gaps, offsets = 0, [], []
            for i in m:
                offsets.append(at)
                pad = -self.sizes[i] % step
                gaps.append(gap[:pad])
                at += self.sizes[i] + pad
            offsets.append(at)  # the weight's element
            self._gaps.append(gaps)
            self._at.append(offsets)
        # Where the ring allows, the means of Keras's own optimizers are read in shared memory; the host's node
        # keeps SHARED_BUCKETS + 1 shared-memory files (one left for the other calls): a model with more buckets
        # would make new files at every call and hold every bucket's region at once.
        self._may_share = self._keeps and len(self.members) <= SHARED_BUCKETS

        def shared(k: int, parts: list[np.ndarray]) -> list[np.ndarray]:
            """Bucket ``k``'s parts reduced into the host's shared memory, as views of where the results lie."""
            assert self._ring is not None
            padded = [a for g, gap in zip(parts, self._gaps[k]) for a in (g, gap)] + [parts[-1]]
            flat = self._ring.shared(padded, k + 1)
            views = [flat[at : at + self.sizes[i]].reshape(shapes[i]) for at, i in zip(self._at[k], self.members[k])]
            return [*views, flat[self._at[k][-1] :][:1]]

        def reducer(k: int) -> Callable[..., list[np.ndarray]]:
            def reduce_bucket(*args: np.ndarray) -> list[np.ndarray]:
                """Bucket ``k``'s gradients (``args``, then this rank's weight) averaged over the ranks into the
                bucket's output arrays, which the graph takes as its results."""
                t0 = time.perf_counter()
                try:
                    *grads, weight = args
                    w = np.float32(weight)
                    if w == 0 or not all(finite(g) for g in grads):
                        parts = self._zeros[k]  # no batch, or left out of this bucket's average on every rank
                        self._bad = self._bad or w != 0
                    elif w != 1:
                        parts = [g * w for g in grads] + [np.full(1, w, np.float32)]  # copies: the graph's are read
                    else:
                        parts = [*grads, one]
                    assert self._ring is not None
                    if self._may_share and self._ring.shares:
                        out = shared(k, parts)  # no copy out: rewritten only at this bucket's next reduction
                    else:
                        kept = self._out[k] if self._keeps else None
                        if kept is None:
                            kept = [aligned(shape) for shape in self._shapes[k]]
                            if self._keeps:
                                self._out[k] = kept
                        self._ring.into(parts, kept)
                        out = kept  # the 1/n is applied as the ring writes the result
                except BaseException as exc:
                    self._error = exc  # raised as itself by exchange(), not as TensorFlow's wrapper
                    raise
                finally:
                    self.waited += time.perf_counter() - t0
                return out

            return reduce_bucket

        def exchanged(grads: list[Any], weight: Any) -> tuple[list[Any], Any]:
            out: list[Any] = [None] * len(grads)
            totals = []
            previous: list[Any] = []
            for k, m in enumerate(self.members):
                with tf.control_dependencies(previous):  # every rank reduces the buckets in the same order
                    reduced = tf.numpy_function(
                        reducer(k), [*(grads[i] for i in m), weight], [tf.float32] * (len(m) + 1), stateful=True
                    )
                for r, i in zip(reduced, m):
                    r.set_shape(shapes[i])
                reduced[-1].set_shape([1])
                previous = list(reduced)
                # mean(w_i g_i) / mean(w_i): with every rank's weight 1 (full batches) the mean is the result
                # already, and the division is skipped (it would multiply by exactly 1).
                total = reduced[-1][0]
                scale = tf.math.divide_no_nan(tf.constant(1.0, tf.float32), total)
                full = tf.equal(total, 1.0)
                for r, i in zip(reduced, m):
                    out[i] = tf.cond(full, lambda r=r: tf.identity(r), lambda r=r, s=scale: r * s)
                totals.append(total)
            return out, tf.stack(totals)

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
        ring: Ring,
    ) -> tuple[None, list[float], bool]:
        """As :meth:`.buckets.Buckets.exchange`, but the ring averages out of place (:meth:`Ring.into`), or, where
        it shares results and the optimizer is one of Keras's own, leaves the mean in the host's shared memory
        for the optimizer to read there (:meth:`Ring.shared`); and
        the optimizer's step is taken here, in the same graph: ``backward`` hands this step's batch to the
        stepper (:meth:`~.steppers.Stepper.backward`), or is ``None`` (no batch: zeros with weight 0). Returns
        ``None`` where :meth:`.buckets.Buckets.exchange` returns the averages (applied already), each bucket's
        mean weight over the ranks (0: no rank sent any; then no step was taken), and whether a bucket of this
        rank's was left out as not finite."""
        tf = self._tf
        self._ring, self._bad, self._error, self.waited = ring, False, None, 0.0
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
            self._ring = None
        return None, totals, self._bad
