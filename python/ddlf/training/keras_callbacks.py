"""Keras' own callbacks (any ``keras.callbacks.Callback``) in ``app.train``, driven as ``fit`` drives them.

``app.train`` wraps each in a :class:`KerasCallback`: ``self.model`` is the master's model, ``params`` holds
``epochs``, ``steps`` (batches a worker trains per epoch) and ``verbose``, and the hooks get ``fit``'s ``logs``
(``val_*`` included). ``on_train_batch_end`` runs once per round (sync) or merged chunk (async), with the round's
logs and, as its ``batch``, the index (from the epoch's start) of the last batch a worker has run by then, as
``fit`` reports it with ``steps_per_execution``: distributed training has no per-batch view on the master. What
a callback does to the model reaches the workers: ``model.stop_training = True`` (EarlyStopping, TerminateOnNaN)
ends training at the end of the round (sync) or chunks in flight (async) it was set in, as ``fit`` ends it at the
batch, and a new learning rate on the master's optimizer (ReduceLROnPlateau,
LearningRateScheduler) is what every worker trains with from the next round (:func:`learning_rate`, carried by each
round's ``learning_rate``). ``BackupAndRestore`` resumes where its backup says, as in ``fit``: the master's model
restored, the workers starting from it.
"""

from __future__ import annotations

import math
from typing import Any

from ..frameworks.adapter import adapter_for
from ..frameworks.model_spec import plain_learning_rate
from .callbacks import Callback


def is_keras_callback(callback: Any) -> bool:
    """Whether ``callback`` is a Keras callback (without importing Keras when the script did not)."""
    import sys

    keras = sys.modules.get("keras")
    return keras is not None and isinstance(callback, keras.callbacks.Callback)


def is_progbar_logger(callback: Any) -> bool:
    """Whether ``callback`` is Keras' ``ProgbarLogger``, which takes the place of ddlf's own bar (as in ``fit``)."""
    import sys

    keras = sys.modules.get("keras")
    return keras is not None and isinstance(callback, keras.callbacks.ProgbarLogger)


def learning_rate(model: Any) -> float | None:
    """The learning rate the master's Keras optimizer holds now (None: not a Keras optimizer with a plain rate,
    e.g. a schedule, which every worker computes alike from its own step count)."""
    return plain_learning_rate(getattr(model, "optimizer", None))


class KerasCallback(Callback):
    """One Keras callback, as ``fit`` would call it (see the module docs)."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback
        self.params: dict[str, Any] = {}
        self.rows = 0
        """Rows an epoch trains (all workers): a round's ``samples_done`` over it gives fit's batch index."""
        self.done = 0
        """Rows the epoch's rounds trained so far."""

    def set_app(self, app: Any) -> None:
        super().set_app(app)
        adapter_for(app.model).clear_stop_training()  # as fit starts
        self.callback.set_model(app.model)

    def set_params(self, params: dict[str, Any], rows: int = 0) -> None:
        """``fit``'s ``params``: ``epochs``, ``steps`` and ``verbose``; ``rows``: what an epoch trains."""
        self.params = dict(params)
        self.rows = rows
        self.callback.set_params(self.params)

    def _after(self) -> None:
        if getattr(self.app.model, "stop_training", False):
            self.app.stop_training = True

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.callback.on_train_begin(dict(logs or {}))
        self._after()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.done = 0
        self.callback.on_epoch_begin(epoch, dict(logs or {}))
        self._after()

    def on_round_begin(self, round: int, logs: dict[str, Any] | None = None) -> None:
        # fit's index of the round's first batch (TensorBoard counts its steps here, and times them to the end)
        steps = int(self.params.get("steps") or 0)
        batch = min(steps - 1, steps * self.done // self.rows) if self.rows and steps else round
        self.callback.on_train_batch_begin(max(0, batch), dict(logs or {}))
        self._after()

    def on_round_end(self, round: int, logs: dict[str, Any] | None = None) -> None:
        logs = dict(logs or {})
        done = logs.pop("samples_done", None)
        steps = int(self.params.get("steps") or 0)
        if done is not None and self.rows and steps:
            # fit's index of the last batch run, counted from the epoch's start (as with steps_per_execution):
            # the share of the epoch's rows done, in a worker's batches (so ProgbarLogger ends at `steps`)
            self.done = int(done)
            batch = min(steps, math.ceil(steps * float(done) / self.rows)) - 1
        else:
            batch = round
        self.callback.on_train_batch_end(max(0, batch), logs)
        self._after()

    def undecided_metric(self) -> str | None:
        """The metric this callback watches (``EarlyStopping``, ``ModelCheckpoint`` with ``mode="auto"``) whose
        direction Keras reads off the model's built metrics, which the master's model lacks: its steps ran on the
        workers (``fit`` builds them at its first step). None when there is nothing to decide."""
        import keras

        cb = self.callback
        if (
            not isinstance(cb, keras.callbacks.EarlyStopping | keras.callbacks.ModelCheckpoint)
            or cb.monitor_op is not None
        ):
            return None
        if getattr(cb, "mode", "auto") in ("min", "max"):
            return None
        name = str(getattr(cb, "monitor", "")).removeprefix("val_")
        return None if name == "loss" else name

    def decide(self, directions: dict[str, str]) -> None:
        """Set the callback's comparison as Keras would from the model's metrics (``directions``: the workers'
        metrics, name -> ``"up"``/``"down"``). A metric not among them is left to Keras, whose error says to pass
        ``mode``."""
        name = self.undecided_metric()
        if name is None or name not in directions:
            return
        from keras import ops

        cb = self.callback
        cb.monitor_op = ops.greater if directions[name] == "up" else ops.less
        if cb.monitor_op == ops.less:
            cb.min_delta *= -1  # as Keras' _set_monitor_op

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        # the run's own dict, as fit hands it on: LearningRateScheduler and ReduceLROnPlateau add learning_rate
        self.callback.on_epoch_end(epoch, logs if logs is not None else {})
        self._after()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        history = (logs or {}).get("history") or {}
        self.callback.on_train_end({k: v[-1] for k, v in history.items() if v})
