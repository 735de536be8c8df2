"""Callbacks for ``app.train``, with Keras' hooks: ``on_train_begin/end``, ``on_epoch_begin/end`` and
(ddlf's own) ``on_round_end``. A callback sees the app (``self.app``), the master's model (``self.model``) and
the run's :class:`~ddlf.History` as it grows (``self.history``, with per-round worker statistics); setting
``self.app.stop_training = True`` ends training at the end of the current round (sync; the chunks in flight, async),
with the epoch's logs of what trained, as ``fit`` ends it at the current batch."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, TextIO

from ..errors import ConfigError, ConfigTypeError
from .history import worker_totals


class Callback:
    """Base class: override the hooks you need."""

    app: Any = None
    model: Any = None
    history: Any = None

    def set_app(self, app: Any) -> None:
        self.app = app
        self.model = app.model

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_train_end(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_round_begin(self, round: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_round_end(self, round: int, logs: dict[str, Any] | None = None) -> None: ...


class ProgressBar(Callback):
    """One line per epoch on the master (and a live line during the epoch when writing to a terminal):
    epoch, time, samples/s, loss and metrics."""

    def __init__(self, epochs: int, samples_per_epoch: int, stream: TextIO | None = None) -> None:
        self.epochs = epochs
        self.samples = samples_per_epoch
        self.stream = stream or sys.stdout
        self._live = self.stream.isatty()
        self._t0 = 0.0
        self._done = 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._t0 = time.perf_counter()
        self._done = 0

    def on_round_end(self, round: int, logs: dict[str, Any] | None = None) -> None:
        if not self._live or not logs:
            return
        self._done = logs.get("samples_done", self._done)
        frac = min(1.0, self._done / max(1, self.samples))
        bar = "=" * int(frac * 30)
        self.stream.write(f"\r{self._done}/{self.samples} [{bar:<30}] loss: {logs.get('loss', float('nan')):.4f}")
        self.stream.flush()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        dt = time.perf_counter() - self._t0
        parts = [f"Epoch {epoch + 1}/{self.epochs}", f"{dt:.1f}s", f"{self.samples / max(dt, 1e-9):,.0f} samples/s"]
        parts += [f"{k}: {v:.4f}" for k, v in (logs or {}).items() if isinstance(v, float)]
        if self._live:
            self.stream.write("\r")
        self.stream.write(" - ".join(parts) + "\n")
        self.stream.flush()


class ModelCheckpoint(Callback):
    """Save the master's model (``.keras`` path) or weights (``.weights.h5``) after each epoch.

    ``filepath`` may contain ``{epoch}`` and any log name (``{val_accuracy:.4f}``). With ``save_best_only``,
    only epochs that improve ``monitor`` are saved. Files are written to a temporary name and renamed, so a crash
    never leaves a half-written checkpoint.
    """

    def __init__(self, filepath: str, monitor: str = "val_loss", save_best_only: bool = False, mode: str = "auto"):
        self.filepath = filepath
        self.monitor = monitor
        self.save_best_only = save_best_only
        self._better = _comparator(monitor, mode)
        self.best: float | None = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = logs or {}
        if self.save_best_only:
            value = logs.get(self.monitor)
            if value is None or (self.best is not None and not self._better(value, self.best)):
                return
            self.best = value
        path = self.filepath.format(epoch=epoch + 1, **logs)
        base, ext = os.path.splitext(path)
        if path.endswith(".weights.h5"):
            tmp = path[: -len(".weights.h5")] + ".tmp.weights.h5"
            self.model.save_weights(tmp)
        else:
            tmp = f"{base}.tmp{ext}"
            self.model.save(tmp)
        os.replace(tmp, path)


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs; optionally put back the
    best weights seen."""

    def __init__(
        self,
        monitor: str = "val_loss",
        patience: int = 0,
        min_delta: float = 0.0,
        mode: str = "auto",
        restore_best_weights: bool = False,
    ) -> None:
        self.monitor = monitor
        self.patience = patience
        self.min_delta = abs(min_delta)
        self.restore_best_weights = restore_best_weights
        self._better = _comparator(monitor, mode, self.min_delta)
        self.best: float | None = None
        self.best_weights: list[Any] | None = None
        self.wait = 0
        self.stopped_epoch: int | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.best, self.best_weights, self.wait, self.stopped_epoch = None, None, 0, None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        value = (logs or {}).get(self.monitor)
        if value is None or math.isnan(value):
            return
        if self.best is None or self._better(value, self.best):
            self.best, self.wait = value, 0
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            self.app.stop_training = True

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self.restore_best_weights and self.best_weights is not None and self.stopped_epoch is not None:
            self.model.set_weights(self.best_weights)


class LambdaCallback(Callback):
    """A callback from plain functions: ``LambdaCallback(on_epoch_end=lambda epoch, logs: ...)``."""

    def __init__(self, **hooks: Any) -> None:
        for name, fn in hooks.items():
            if not name.startswith("on_"):
                raise ConfigTypeError(f"unknown hook {name!r}")
            setattr(self, name, fn)


def _comparator(monitor: str, mode: str, min_delta: float = 0.0) -> Any:
    if mode == "auto":
        mode = "max" if any(k in monitor for k in ("acc", "auc", "precision", "recall")) else "min"
    if mode == "max":
        return lambda new, best: new > best + min_delta
    if mode == "min":
        return lambda new, best: new < best - min_delta
    raise ConfigError(f"mode must be 'auto', 'min' or 'max', not {mode!r}")


class TensorBoard(Callback):
    """Write TensorBoard event files under ``log_dir``, the way Keras' callback lays them out: ``train/`` and
    ``validation/`` runs with ``epoch_loss``, ``epoch_accuracy`` (and every other metric), plus ddlf's own
    scalars in the ``train`` run: ``ddlf/samples_per_second``, ``ddlf/bytes_on_wire``, and per worker
    ``ddlf/worker_<i>/compute_seconds``, ``.../data_wait_seconds``, ``.../communication_seconds`` and
    ``.../wait_seconds`` (summed over the epoch's rounds). ``update_freq="round"`` also writes ``round_loss``
    every round.

    Needs ``tensorboardX`` (``pip install tensorboardX``) or PyTorch (``torch.utils.tensorboard``); view with
    ``tensorboard --logdir <log_dir>``.
    """

    def __init__(self, log_dir: str | os.PathLike[str] = "logs", update_freq: str = "epoch") -> None:
        if update_freq not in ("epoch", "round"):
            raise ConfigError(f"update_freq must be 'epoch' or 'round', not {update_freq!r}")
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self._writer_class = _summary_writer_class()
        self._train: Any = None
        self._val: Any = None
        self._round_step = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._train = self._writer_class(os.path.join(self.log_dir, "train"))
        self._val = self._writer_class(os.path.join(self.log_dir, "validation"))

    def on_round_end(self, round: int, logs: dict[str, Any] | None = None) -> None:
        if self.update_freq != "round" or self._train is None or not logs:
            return
        if isinstance(logs.get("loss"), float) and math.isfinite(logs["loss"]):
            self._train.add_scalar("round_loss", logs["loss"], self._round_step)
        self._round_step += 1

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._train is None:
            return
        for key, value in (logs or {}).items():
            if not isinstance(value, (int, float)):
                continue
            if key.startswith("val_"):
                self._val.add_scalar(f"epoch_{key[4:]}", float(value), epoch)
            else:
                self._train.add_scalar(f"epoch_{key}", float(value), epoch)
        if self.history is not None:
            self._worker_scalars(epoch)
        self._train.flush()
        self._val.flush()

    def _worker_scalars(self, epoch: int) -> None:
        stats = [s for s in self.history.stats if s.epoch == epoch and not s.lost]
        seconds = self.history.epoch_seconds[-1] if self.history.epoch_seconds else 0.0
        if seconds > 0:
            self._train.add_scalar("ddlf/samples_per_second", sum(s.samples for s in stats) / seconds, epoch)
        self._train.add_scalar("ddlf/bytes_on_wire", float(sum(s.bytes_sent + s.bytes_received for s in stats)), epoch)
        for w, row in sorted(worker_totals(stats).items()):
            for tag, value in (
                ("compute_seconds", row["compute_seconds"]),
                ("data_wait_seconds", row["data_wait_seconds"]),
                ("communication_seconds", row["send_seconds"] + row["comm_seconds"]),
                ("wait_seconds", row["wait_seconds"]),
            ):
                self._train.add_scalar(f"ddlf/worker_{w}/{tag}", value, epoch)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        for writer in (self._train, self._val):
            if writer is not None:
                writer.close()
        self._train = self._val = None


def _summary_writer_class() -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "ddlf.callbacks.TensorBoard writes event files with tensorboardX or PyTorch: "
                "pip install tensorboardX (and tensorboard to view them)"
            ) from None
    return SummaryWriter
