"""Hyperparameter sweeps: many trials at once on groups of workers, the weakest stopped early (ASHA).

```python
def make_app(cluster, config):
    return MnistApp(cluster, lr=config["lr"], width=config["width"])

result = ddlf.sweep(cluster, make_app, [{"lr": lr, "width": w} for lr in (1e-3, 3e-3) for w in (32, 128)],
                    epochs=9, metric="val_accuracy", validation_data=(x_test, y_test))
result.best.config, result.table()
```

The cluster's workers are cut into groups of ``workers_per_trial``; each group trains one trial at a time (a
``workers=`` run of :meth:`IApp.train`, isolated from the others on shared daemons), taking the next config when
its trial ends. Every worker loads the dataset once and reuses it for every trial (its store is keyed by the app's
``dataset_key``).

Early stopping is asynchronous successive halving (ASHA, Li et al. 2018) with Ray Tune's ``ASHAScheduler`` cut:
rungs at ``grace_epochs * reduction_factor**k`` epochs; a trial reaching a rung stops there when its metric is
below the ``1 - 1/reduction_factor`` percentile of the metrics that reached that rung before it (so roughly the
best ``1 / reduction_factor`` continue). No trial waits for another.

``report="sweep.html"`` writes the sweep's page: the best trial, every trial's metric per epoch, the worker groups
over time, and the table of trials.

A lost worker fails only its trial: the trial is queued again (once) for another group, and a group whose workers
are all lost takes no more trials.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ..errors import ConfigError, ConfigTypeError, NotFoundError, WorkerUnavailable
from ..training.callbacks import Callback
from ..training.options import DataConfig, RunConfig, Strategy, validates
from .asha import _Asha
from .result import SweepResult, Trial


class _Report(Callback):
    """Reports a trial's metric to ASHA after each epoch and stops the trial where ASHA says so."""

    def __init__(
        self, trial: Trial, asha: _Asha, metric: str, mode: str, validated: Callable[[int], bool] | None = None
    ) -> None:
        self.trial, self.asha, self.metric, self.mode = trial, asha, metric, mode
        self.validated = validated

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = logs or {}
        if self.metric not in logs and self.validated is not None and not self.validated(epoch):
            self.trial.epochs = epoch + 1  # validation_freq skipped this epoch (never a rung: checked up front)
            return
        if self.metric not in logs:
            raise NotFoundError(f"the sweep's metric {self.metric!r} is not in the epoch's logs {sorted(logs)}")
        value = float(logs[self.metric])
        best = self.trial.metric
        if best is None or (value > best if self.mode == "max" else value < best):
            self.trial.metric = value
        self.trial.epochs = epoch + 1
        if not self.asha.keep_going(epoch + 1, value):
            self.trial.status = "stopped"
            self.app.stop_training = True


def sweep(
    cluster: Any,
    make_app: Callable[[Any, dict[str, Any]], Any],
    configs: Sequence[dict[str, Any]],
    *,
    epochs: int,
    metric: str = "val_accuracy",
    mode: Literal["max", "min"] = "max",
    workers_per_trial: int = 1,
    grace_epochs: int = 1,
    reduction_factor: float = 3.0,
    validation_data: Any = None,
    retries: int = 1,
    strategy: Strategy | None = None,
    data: DataConfig | None = None,
    run: RunConfig | None = None,
    report: str | os.PathLike[str] | None = None,
    **train_kwargs: Any,
) -> SweepResult:
    """Train ``make_app(cluster, config)`` for every config, several at once, stopping the weakest early.

    Args:
        make_app: builds the trial's app (an :class:`~ddlf.IApp`) for a config; its ``dataset_key`` decides the
            cached dataset every trial reuses.
        epochs: the most epochs a trial trains.
        metric: what ranks trials (a key of the epoch logs: ``val_*`` needs ``validation_data``).
        mode: whether a higher (``"max"``) or lower (``"min"``) ``metric`` is better.
        workers_per_trial: workers each trial trains on.
        grace_epochs: ASHA's first rung.
        reduction_factor: the ratio between ASHA's rungs (also the share kept).
        retries: how many times a trial that lost its workers is queued again (after the run's
            ``rejoin_timeout``, 5 s unless ``run`` is given, without any of them back).
        strategy: each trial's strategy, as in :meth:`IApp.train`.
        data: each trial's data options, as in :meth:`IApp.train`.
        run: each trial's run options, as in :meth:`IApp.train` (``run.workers`` is set per trial to its group).
        report: an ``.html`` path: the sweep's page (:meth:`SweepResult.write_report`) is written there at the end.
        train_kwargs: ``fit``'s other arguments, passed to :meth:`IApp.train` (``batch_size``, ...).
            ``callbacks``: each trial gets its own copy (``copy.deepcopy``), as each trial is its own ``fit``:
            trials run at once, and one ``EarlyStopping`` must not see two trials' epochs (a callback meant to be
            shared defines ``__deepcopy__`` returning itself). Callbacks that write to a path (checkpoints,
            backups, CSV and TensorBoard logs) are refused: the trials would write over each other. ``verbose``
            is 0 unless given (the trials' progress bars would interleave). ``validation_freq`` must validate at
            every rung when ``metric`` is a validation metric.
    """
    if not configs:
        raise ConfigError("configs is empty: give at least one")
    if mode not in ("max", "min"):
        raise ConfigError(f"mode must be 'max' or 'min', not {mode!r}")
    if epochs < 1 or grace_epochs < 1 or reduction_factor <= 1:
        raise ConfigError("epochs and grace_epochs must be at least 1 and reduction_factor above 1")
    if not all(isinstance(c, dict) for c in configs):
        raise ConfigTypeError("configs must be a list of dicts (one per trial)")
    live = cluster.live_workers
    if workers_per_trial < 1 or workers_per_trial > len(live):
        raise ConfigError(f"workers_per_trial must be from 1 to {len(live)} (the live workers)")
    if metric.startswith("val_") and validation_data is None and not train_kwargs.get("validation_split"):
        raise ConfigError(f"metric {metric!r} is a validation metric: pass validation_data=(x, y) or validation_split")
    if report is not None:
        from ..report.training import check_report_path

        check_report_path(report)
    callbacks = list(train_kwargs.pop("callbacks", None) or [])
    verbose = train_kwargs.pop("verbose", 0)
    _check_callbacks(callbacks)
    # A trial whose workers are all lost gives up after this long and is queued again elsewhere.
    run = run if run is not None else RunConfig(rejoin_timeout=5.0)
    groups = [live[i : i + workers_per_trial] for i in range(0, len(live) - workers_per_trial + 1, workers_per_trial)]
    trials = [Trial(i, dict(c)) for i, c in enumerate(configs)]
    todo: queue.Queue[Trial] = queue.Queue()
    for t in trials:
        todo.put(t)
    asha = _Asha(epochs, grace_epochs, reduction_factor, mode)
    validated = None
    if metric.startswith("val_") and train_kwargs.get("validation_freq", 1) != 1:
        freq = train_kwargs["validation_freq"]
        validated = functools.partial(validates, set(freq) if not isinstance(freq, int) else freq)
        skipped = [r for r in asha.rungs if not validated(r - 1)]
        if skipped:
            raise ConfigError(
                f"validation_freq={train_kwargs['validation_freq']!r} leaves the rungs at epochs {skipped} without "
                f"{metric!r}, which ASHA judges trials by there (rungs: {asha.rungs}); validate at every rung"
            )
    t0 = time.perf_counter()
    done = threading.Event()
    lock = threading.Lock()
    ended = [0]

    def finish() -> None:
        with lock:
            ended[0] += 1
            if ended[0] == len(trials):
                done.set()

    def span(trial: Trial, start: float, group: list[int]) -> None:
        trial.spans.append((start - t0, time.perf_counter() - t0, list(group)))

    def run_group(group: list[int]) -> None:
        while not done.is_set():
            try:
                trial = todo.get(timeout=0.2)
            except queue.Empty:
                continue
            trial.status, trial.workers, trial.attempts = "running", list(group), trial.attempts + 1
            start = time.perf_counter()
            try:
                app = make_app(cluster, trial.config)
                trial.history = app.train(
                    epochs=epochs,
                    strategy=strategy,
                    data=data,
                    run=dataclasses.replace(run, workers=tuple(group)),
                    validation_data=validation_data,
                    callbacks=[_Report(trial, asha, metric, mode, validated), *_own_copies(callbacks)],
                    verbose=verbose,
                    **train_kwargs,
                )
                if trial.status == "running":
                    trial.status = "completed"
            except WorkerUnavailable as exc:
                span(trial, start, group)
                if trial.attempts <= retries:
                    trial.status, trial.metric, trial.epochs = "pending", None, 0
                    todo.put(trial)  # another group takes it
                else:
                    trial.status, trial.error = "failed", exc
                    finish()
                if not any(w in cluster.live_workers for w in group):
                    return  # this group's workers are gone: it takes no more trials
                continue
            except Exception as exc:
                trial.status, trial.error = "failed", exc
            span(trial, start, group)
            finish()

    threads = [threading.Thread(target=run_group, args=(g,), name=f"ddlf-sweep-{g}", daemon=True) for g in groups]
    for th in threads:
        th.start()
    while not done.wait(0.5):
        if not any(th.is_alive() for th in threads):  # every group lost: fail what is left
            for t in trials:
                if t.status in ("pending", "running"):
                    t.status = "failed"
                    t.error = t.error or WorkerUnavailable("every worker group was lost before this trial ran")
            break
    for th in threads:
        th.join()
    result = SweepResult(trials, metric, mode, time.perf_counter() - t0)
    if report is not None:
        result.write_report(report)
    return result


# Callbacks that write to a path of their own: the trials, running at once, would write one place.
_PATH_CALLBACKS = ("BackupAndRestore", "ModelCheckpoint", "CSVLogger", "TensorBoard")


def _check_callbacks(callbacks: list[Any]) -> None:
    """Refuse, before any trial starts, callbacks that trials running at once cannot each have a copy of."""
    for cb in callbacks:
        name = type(cb).__name__
        if name in _PATH_CALLBACKS and type(cb).__module__.split(".")[0] in ("keras", "ddlf"):
            raise ConfigError(
                f"callbacks: a {name} writes to one path, and a sweep's trials run at once: they would write "
                "over each other (and BackupAndRestore would resume one trial from another's state). Keep "
                "each trial's results through SweepResult (result.trials[i].history) or its report="
            )
    try:
        _own_copies(callbacks)
    except Exception as exc:
        raise ConfigTypeError(
            f"callbacks: each trial gets its own copy (copy.deepcopy), and these cannot be copied ({exc}); a "
            "callback meant to be shared by every trial defines __deepcopy__ returning itself"
        ) from exc


def _own_copies(callbacks: list[Any]) -> list[Any]:
    """A trial's own copies of ``callbacks``: what a callback took from an earlier run (its app, model and
    history) is not copied but left out, and the standard streams are shared."""
    memo: dict[int, Any] = {id(s): s for s in (sys.stdout, sys.stderr)}
    for cb in callbacks:
        for attr in ("app", "model", "history", "_model"):
            held = vars(cb).get(attr) if hasattr(cb, "__dict__") else None
            if held is not None:
                memo[id(held)] = None
    return copy.deepcopy(callbacks, memo)
