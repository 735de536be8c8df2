"""Tracing a step once for batches of any size (Keras on TensorFlow)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger("ddlf.training")


class AnyBatchSize:
    """``fn`` (a ``tf.function``), traced on its first call by :func:`any_batch_size` for batches of any size
    like that call's (the arguments' ``leading`` dimensions unknown), then called; other attributes are
    ``fn``'s."""

    def __init__(self, tf: Any, fn: Any, leading: int = 1) -> None:
        self._tf, self._fn, self._leading = tf, fn, leading
        self._traced = False

    def __call__(self, *args: Any) -> Any:
        if not self._traced:
            any_batch_size(self._tf, self._fn, *args, leading=self._leading)
            self._traced = True
        return self._fn(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


def any_batch_size(tf: Any, fn: Any, *batch: Any, leading: int = 1) -> None:
    """Trace ``fn`` (a ``tf.function``) once for batches of any size like ``batch``'s arrays (their ``leading``
    dimensions unknown: 2 for a stack of batches), as ``fit`` traces its step over a dataset whose batches may be
    short: the epoch's last, short batch then runs the same graph, where tracing for the first batch's exact
    shape would trace again there (a second compilation in the first epoch, half a second for a small LSTM).
    The ``tf.function``'s later calls with a full or short batch find this trace. ``None`` (no sample weights)
    stays ``None``, and anything that is not an array (a tensor already) is traced as it is. A model that cannot
    be traced so (one built for a fixed batch size, a stateful RNN's) is traced at its first call, as before."""

    def spec(a: Any) -> Any:
        if isinstance(a, np.ndarray) and a.ndim >= leading:
            return tf.TensorSpec([None] * leading + list(a.shape[leading:]), tf.as_dtype(a.dtype))
        return a

    try:
        fn.get_concrete_function(*(tf.nest.map_structure(spec, b) for b in batch))
    except Exception as exc:
        log.debug("traced for this batch's shape only: %s", exc)
