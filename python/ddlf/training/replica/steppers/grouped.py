"""Whole steps gathered for one compiled call (Keras on TensorFlow's model averaging)."""

from __future__ import annotations

from typing import Any

import numpy as np

GROUP_STEPS = 16
"""On TensorFlow, model averaging's rounds run up to this many whole steps in one ``tf.function`` call (as Keras's
``steps_per_execution``): a small model's step costs less than the call into it (BENCHMARKS.md, *Small models*).
Not on JAX, whose calls are dispatched asynchronously: there the same loop (``lax.fori_loop`` or ``scan``) made the
CNN's epoch far slower on CPU and added seconds of compiling."""
GROUP_BYTES = 8 << 20
"""...and only while the gathered batches of one call take at most this many bytes (large batches gain nothing)."""


def _joins(stack: np.ndarray | None, a: np.ndarray) -> bool:
    return stack is not None and stack.shape[1:] == a.shape and stack.dtype == a.dtype


class _Grouped:
    """Gathers a round's batches into a stack of :data:`GROUP_STEPS` for ``many(xs, ys, n)``, one compiled call
    that steps through the first ``n`` in order (``n`` is an argument of the call, not of its compilation: one
    compiled loop serves full stacks and the round's last, partial one). ``one(x, y, sw)`` steps a batch that
    cannot join a stack (not a numpy array (a dict of named inputs), weighted, or too large to gain from it).
    The steps and their order are those of one
    call each."""

    def __init__(self, one: Any, many: Any) -> None:
        self._one, self._many = one, many
        self._xs: np.ndarray | None = None
        self._ys: np.ndarray | None = None
        self._n = 0

    def add(self, x: Any, y: Any, sw: Any = None) -> None:
        if type(x) is not np.ndarray or type(y) is not np.ndarray or sw is not None:
            self.flush()
            self._one(x, y, sw)
            return
        xs, ys = self._xs, self._ys
        if not (_joins(xs, x) and _joins(ys, y)):
            self.flush()
            k = min(GROUP_STEPS, GROUP_BYTES // max(1, x.nbytes + y.nbytes))
            if k < 2:
                self._one(x, y, None)
                return
            # A new stack each time: the framework may keep a reference to the last one (TensorFlow can alias a
            # numpy array's memory).
            xs = self._xs = np.empty((k, *x.shape), x.dtype)
            ys = self._ys = np.empty((k, *y.shape), y.dtype)
        assert xs is not None and ys is not None
        xs[self._n] = x
        ys[self._n] = y
        self._n += 1
        if self._n == len(xs):
            self.flush()

    def flush(self) -> None:
        """Step the gathered batches now."""
        xs, ys, n = self._xs, self._ys, self._n
        self._xs = self._ys = None
        self._n = 0
        if n:
            self._many(xs, ys, n)
