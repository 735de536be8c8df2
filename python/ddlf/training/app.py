"""``IApp``: subclass it, implement ``load_dataset()`` and ``create_model()``, and train on the cluster.

```python
class MnistApp(ddlf.IApp):
    dataset_key = "mnist-v1"
    def load_dataset(self):            # runs once per worker; cached under dataset_key
        (x, y), _ = ddlf.datasets.mnist("examples/data/mnist")
        return x, y
    def create_model(self):            # runs on the master and on each worker
        ...
        return model

with ddlf.Cluster.local(2) as cluster:
    history = MnistApp(cluster).train(epochs=10, batch_size=64)
```
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import data as datasets
from .. import serialization
from ..cluster.cluster import Cluster
from ..data.images import EncodedImages
from ..data.structure import concatenate_rows
from ..errors import (
    ConfigError,
    ConfigTypeError,
    ConfigWarning,
    DatasetError,
    ModelChangeWarning,
    OutOfRangeError,
    WorkerUnavailable,
)
from ..frameworks import model_spec
from ..frameworks.adapter import adapter_for
from ..frameworks.keras_backend import keras_backend_default
from ..frameworks.loading import guard_torch_compiler
from ..frameworks.seeding import keras_loaded_since, set_random_seed
from ..process import frozen_heap
from ..report.training import check_report_path, write_report
from . import checkpoint, master_optimizer
from . import replica as remote
from .asynchronous import train_async as _train_async
from .callbacks import ProgressBar
from .defaults import default_strategy
from .exchange import resolve as resolve_exchange
from .history import History
from .keras_callbacks import KerasCallback, is_keras_callback, is_progbar_logger
from .membership import Members
from .messages import FitData
from .options import DataConfig, GradientAveraging, ModelAveraging, RunConfig, Strategy, TrainConfig, _positive_int
from .preemption import Preemption
from .remote_evaluation import contiguous_parts, evaluate_on_workers, predict_on_workers
from .replica.sharded import check_shardable
from .replica.steppers import check_steppable
from .run import RunState, TrainingRun
from .synchronous import train_sync as _train_sync

_SEEDING = threading.Lock()
"""Held while an app seeds the process's random generators and draws its model's initial weights from them."""


class IApp:
    """A distributed training application.

    Subclasses implement :meth:`load_dataset` (runs once on each worker, result cached in the worker's dataset
    store under :attr:`dataset_key`) and :meth:`create_model` (a compiled Keras model; runs on the master and on
    every worker). Optionally :meth:`preprocess` turns each raw batch into model inputs on the worker, so the store
    can keep compact raw data (uint8 images) and convert per batch.
    """

    dataset_key: str | None = None
    """Worker-side cache key of the dataset; defaults to the class's qualified name. A daemon keeps the dataset
    under it across runs and scripts without calling :meth:`load_dataset` again: change it when what that loads
    changes (or ``cluster.drop_dataset(key)``)."""

    sharded: bool = False
    """Set by apps whose dataset is larger than one worker: each worker then loads only its shard with
    :meth:`load_shard`, and shuffling happens within each shard."""

    def __init__(self, cluster: Cluster) -> None:
        keras_backend_default()  # the master builds the model too: the same backend as its workers
        guard_torch_compiler()  # a TorchModel's optimizer after TensorFlow: an error, not an abort
        self.cluster = cluster
        self.model: Any = None
        self.stop_training = False
        self.epochs_done = 0
        """Epochs trained so far (by this app's train calls, or restored from a checkpoint)."""
        if self.dataset_key is None:
            self.dataset_key = f"{type(self).__module__}.{type(self).__qualname__}"

    # -- to implement -----------------------------------------------------------------------------------

    def load_dataset(self) -> Any:
        """Return the training data as ``(x, y)`` (or ``{"x": ..., "y": ...}``) numpy arrays. Runs on workers."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_dataset() (or be sharded: load_shard)")

    def create_model(self) -> Any:
        """Return a compiled Keras model (any backend), or a ``ddlf.models.TorchModel`` wrapping a torch module.
        Runs on the master and on every worker."""
        raise NotImplementedError(f"{type(self).__name__} must implement create_model()")

    def load_shard(self, shard: int, n_shards: int) -> Any:
        """For ``sharded = True`` apps: return shard ``shard`` of ``n_shards`` as ``(x, y)``. Runs on workers;
        worker ``i`` loads shard ``i`` (and others only when shards rotate)."""
        raise NotImplementedError("set sharded = True and implement load_shard(shard, n_shards)")

    def preprocess(self, x: Any, y: Any) -> tuple[Any, Any]:
        """Turn one raw batch into model inputs (default: unchanged). Runs on workers, per batch."""
        return x, y

    # -- training ---------------------------------------------------------------------------------------

    def train(
        self,
        epochs: int = 1,
        batch_size: int | None = 32,
        *,
        validation_data: tuple[Any, Any] | None = None,
        validation_split: float = 0.0,
        validation_freq: int | Sequence[int] = 1,
        shuffle: bool = True,
        class_weight: dict[int, float] | None = None,
        sample_weight: Any = None,
        callbacks: Sequence[Any] = (),
        verbose: int = 1,
        initial_epoch: int = 0,
        strategy: Strategy | None = None,
        data: DataConfig | None = None,
        run: RunConfig | None = None,
    ) -> History:
        """Train on the cluster, as Keras' ``model.fit`` trains in one process; returns a Keras-like
        :class:`~ddlf.History`.

        ``epochs``, ``batch_size``, ``validation_data``, ``validation_split``, ``validation_freq``, ``shuffle``,
        ``class_weight``, ``sample_weight``, ``callbacks``, ``verbose``, ``initial_epoch``: as in ``fit``.
        ``batch_size`` is each worker's; ``validation_data`` ``(x, y)`` (arrays the master holds, raw as
        :meth:`load_dataset`'s rows: :meth:`preprocess` runs on them) is evaluated on the master's model;
        ``validation_split`` holds out the last share of the rows the workers loaded (before shuffling), evaluated
        on the workers where those rows are (the ``val_*`` logs are what ``evaluate`` gives over all of them);
        ``validation_data`` wins over it, as in ``fit``. ``sample_weight``: one weight per row (an array), or a
        function ``(x, y) -> weights`` of each batch, run on the workers (weights can also come from
        ``load_dataset`` as a third part). ``callbacks`` are Keras' own (``keras.callbacks.EarlyStopping``, ...; see
        :mod:`ddlf.training.keras_callbacks`) or ddlf's (:mod:`ddlf.callbacks`).

        Args:
            strategy: how the workers learn together (:mod:`ddlf.training.options`): :class:`~ddlf.ModelAveraging`
                (the paper's parameter averaging, one round per epoch unless ``every=`` batches),
                :class:`~ddlf.GradientAveraging` (every step, n workers as one process at n times the batch) or
                :class:`~ddlf.Asynchronous` (each worker at its own pace). ``None``: ddlf's default
                (:mod:`ddlf.training.defaults`), gradient averaging with the learning rate scaled by the number
                of workers where the model allows it (so that an epoch learns about as much as ``fit``'s epoch at
                ``batch_size``), model averaging otherwise; ``history.params["strategy"]`` says which, and
                ``["strategy_reason"]`` why.
            data: how rows reach the workers (:class:`~ddlf.DataConfig`).
            run: which workers, seed, checkpoints, report and failure policy (:class:`~ddlf.RunConfig`).

        Lost workers never stop training (unless the failure policy says so): see :mod:`ddlf.training.synchronous`
        and :mod:`ddlf.training.asynchronous` for what happens to their rows, and ``history.events`` for what
        happened.
        """
        run = run if run is not None else RunConfig()
        reason: str | None = None
        resumed: dict[str, Any] | None = None
        if strategy is None:  # ddlf's default, chosen for this model and cluster (ddlf.training.defaults)
            if not isinstance(run, RunConfig):
                raise ConfigTypeError(f"run must be a ddlf.RunConfig, not {run!r}")
            self._seed_and_build(run.seed)  # as _run does
            if run.resume and run.checkpoint_dir:
                resumed = checkpoint.load(run.checkpoint_dir)
            strategy, reason = default_strategy(self.model, self._worker_count(run), resumed)
        cfg = TrainConfig(
            epochs=epochs,
            batch_size=32 if batch_size is None else batch_size,  # fit's default for None
            strategy=strategy,
            data=data if data is not None else DataConfig(),
            run=run,
            verbose=verbose,
            fit=FitData(validation_split, shuffle, class_weight, sample_weight),
            validation_freq=validation_freq if isinstance(validation_freq, int) else tuple(validation_freq),
        )
        if validation_data is not None and cfg.fit.validation_split:
            fit = dataclasses.replace(cfg.fit, validation_split=0.0)  # fit's rule: validation_data wins
            cfg = dataclasses.replace(cfg, fit=fit)
        cfg = self._check(cfg)
        self._warn_suspicious(cfg, validation_data is not None or bool(cfg.fit.validation_split), initial_epoch)
        self._next_run = RunState(strategy_reason=reason, resumed=resumed)  # what _run starts from
        try:
            if cfg.mode == "sync":
                return self.train_sync(cfg, validation_data, callbacks, initial_epoch)
            return self.train_async(cfg, validation_data, callbacks, initial_epoch)
        finally:
            # an override that raised before its run started leaves nothing for a later call to pick up
            self.__dict__.pop("_next_run", None)

    def _check(self, cfg: TrainConfig) -> TrainConfig:
        """What the options cannot check alone, against this app and its cluster (before any worker sets up);
        the options with model averaging's exchange resolved for the cluster."""
        n = len(self.cluster)
        shares, workers = cfg.data.worker_shares, cfg.run.workers
        if workers is not None:
            bad = [w for w in workers if w >= n]
            if bad:
                raise OutOfRangeError(f"RunConfig.workers {bad} out of range: the cluster has {n} workers")
            if self.sharded:
                raise ConfigError("RunConfig.workers needs a whole-dataset app: a sharded app trains on every shard")
        if shares is not None and len(shares) != n:
            raise ConfigError(
                f"DataConfig.worker_shares has {len(shares)} entries for {n} workers: give one per worker"
            )
        if cfg.data.rotate_shards_every is not None and not self.sharded:
            raise ConfigError("DataConfig.rotate_shards_every needs a sharded app (sharded = True)")
        if cfg.run.report is not None:
            check_report_path(cfg.run.report)
        if isinstance(cfg.strategy, ModelAveraging):
            targets = list(workers) if workers is not None else list(range(n))
            cfg = dataclasses.replace(cfg, exchange=resolve_exchange(cfg.strategy.exchange, self.cluster, targets))
        return cfg

    def _warn_suspicious(self, cfg: TrainConfig, validating: bool, initial_epoch: int) -> None:
        """Options that work but are probably not what was meant: a :class:`~ddlf.errors.ConfigWarning` each (from
        the caller of :meth:`train`)."""
        epochs = range(initial_epoch, cfg.epochs)
        if validating and epochs and not any(cfg.validates(e) for e in epochs):
            warnings.warn(
                f"validation_freq={cfg.validation_freq!r} validates after none of this run's epochs "
                f"({initial_epoch + 1} to {cfg.epochs}): the run has no val_* logs",
                ConfigWarning,
                stacklevel=3,
            )
        k = cfg.data.rotate_shards_every
        if k is not None and self.sharded and len(self.cluster) > 1 and cfg.epochs <= k:
            warnings.warn(
                f"DataConfig.rotate_shards_every={k} with epochs={cfg.epochs}: the shards never rotate in this run "
                "(each worker trains on its own shard only)",
                ConfigWarning,
                stacklevel=3,
            )

    def train_sync(
        self, cfg: TrainConfig, validation_data: Any = None, callbacks: Sequence[Any] = (), initial_epoch: int = 0
    ) -> History:
        """Synchronous training (see :mod:`ddlf.training.synchronous`). Override to customise."""
        return self._run(_train_sync, cfg, validation_data, callbacks, initial_epoch, "sync")

    def train_async(
        self, cfg: TrainConfig, validation_data: Any = None, callbacks: Sequence[Any] = (), initial_epoch: int = 0
    ) -> History:
        """Asynchronous training (see :mod:`ddlf.training.asynchronous`). Override to customise."""
        return self._run(_train_async, cfg, validation_data, callbacks, initial_epoch, "async")

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int = 256,
        *,
        sample_weight: Any = None,
        verbose: int = 0,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Evaluate the master's model, as Keras' ``model.evaluate``.

        With ``x`` (arrays the master holds: an array, a dict of named inputs, a DataFrame...): on the master,
        after :meth:`preprocess`; encoded images (:class:`ddlf.datasets.EncodedImages`) are decoded batch by batch,
        never all at once. Without ``x``: on the workers, over the dataset they loaded (each a contiguous part of
        the rows; a sharded app: each its own shard), with the master's weights: the results are ``evaluate``'s
        over all the rows (metric states added up across the workers). Returns the loss, or a list of loss and
        metrics, or with ``return_dict`` a dict, as Keras does."""
        _positive_int(batch_size, "evaluate()'s batch_size")
        if x is None:
            if y is not None or sample_weight is not None or kwargs:
                given = ", ".join(["y"] * (y is not None) + ["sample_weight"] * (sample_weight is not None) + [*kwargs])
                raise ConfigError(
                    f"evaluate() without x evaluates every row of the workers' dataset: it takes no {given}"
                )
            logs = self._on_workers("evaluate", batch_size)
            if return_dict:
                return logs
            values = list(logs.values())
            return values[0] if len(values) == 1 else values
        if isinstance(x, EncodedImages):
            if sample_weight is not None:
                raise ConfigError("evaluate() on EncodedImages takes no sample_weight")
            self._ensure_model()
            batches = datasets.batches([x, y], batch_size=batch_size, preprocess=self.preprocess)
            steps = -(-len(x) // batch_size)
            cap = kwargs.pop("steps", None)  # Keras's: at most this many batches
            if cap is not None:
                steps = min(steps, int(cap))
            return self.model.evaluate(batches, steps=steps, verbose=verbose, return_dict=return_dict, **kwargs)
        self._ensure_model()
        x, y = self.preprocess(x, y)
        if sample_weight is not None:
            kwargs["sample_weight"] = sample_weight
        return self.model.evaluate(x, y, batch_size=batch_size, verbose=verbose, return_dict=return_dict, **kwargs)

    def predict(self, x: Any = None, batch_size: int = 256, *, verbose: int = 0, **kwargs: Any) -> Any:
        """The master's model's predictions, as Keras' ``model.predict``: for ``x`` (after :meth:`preprocess`,
        on the master, batch by batch), or without ``x`` for every row of the workers' dataset, computed on the
        workers with the master's weights and returned in row order (a sharded app: shard after shard)."""
        _positive_int(batch_size, "predict()'s batch_size")
        if (x is None or isinstance(x, EncodedImages)) and kwargs:
            where = "every row of the workers' dataset" if x is None else "EncodedImages batch by batch"
            raise ConfigError(f"predict() of {where} takes no {', '.join(kwargs)}")
        if x is None:
            return self._on_workers("predict", batch_size)
        if isinstance(x, EncodedImages):
            self._ensure_model()
            rows = [x, np.zeros(len(x), np.int8)]
            outs = [
                self.model.predict_on_batch(bx)
                for bx, _ in datasets.batches(rows, batch_size=batch_size, preprocess=self.preprocess)
            ]
            return concatenate_rows(outs)
        self._ensure_model()
        x, _ = self.preprocess(x, None)
        return self.model.predict(x, batch_size=batch_size, verbose=verbose, **kwargs)

    def _ensure_model(self) -> None:
        """An app evaluated or asked to predict before any ``train()``: its model from :meth:`create_model`, as
        evaluating on the workers does."""
        if self.model is None:
            self.model = self.create_model()

    def _on_workers(self, what: str, batch_size: int) -> Any:
        """Evaluate or predict (``what``) on the workers over the dataset they hold, with the master's weights: a
        short run is set up (the dataset from each worker's store, the model built there), used and torn down."""
        self._ensure_model()
        run_id = f"{what}-{uuid.uuid4().hex[:8]}"
        members = Members(self, run_id, 0, History(), fit=FitData(shuffle=False))
        live = members.live(first=True)
        if not live:
            raise WorkerUnavailable(f"app.{what}() needs a live worker: every worker is lost")
        try:
            infos = [members.info[self.cluster.addresses[w]] for w in live]
            self._build_from_workers(infos)
            if self.sharded:
                parts = [(0, int(i["rows"])) for i in infos]
            else:
                parts = contiguous_parts(0, int(infos[0]["rows"]), len(live), batch_size)
            weights = [np.asarray(w) for w in self.model.get_weights()]
            if what == "evaluate":
                return evaluate_on_workers(self.cluster, run_id, live, weights, list(parts), batch_size)
            return predict_on_workers(self.cluster, run_id, live, weights, parts, batch_size)
        finally:
            members.close()
            with contextlib.suppress(Exception):
                self.cluster.call(remote.teardown, (run_id,), workers=members.candidates(), return_exceptions=True)

    # -- internals --------------------------------------------------------------------------------------

    def _worker_count(self, run: RunConfig) -> int:
        """How many workers a run with ``run`` trains on: those it names, else the whole cluster."""
        return len(run.workers) if run.workers is not None else len(self.cluster)

    def validate(self, data: tuple[Any, ...]) -> dict[str, float]:
        """Evaluate the master's model on ``(x, y)`` or ``(x, y, sample_weight)`` (after :meth:`preprocess`):
        Keras's ``val_*`` logs."""
        if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
            raise ConfigError("validation_data must be (x, y) or (x, y, sample_weight), as in fit")
        sw = data[2] if len(data) == 3 else None
        out = self.evaluate(data[0], data[1], batch_size=512, sample_weight=sw, return_dict=True)
        return {f"val_{k}": float(v) for k, v in out.items()}

    def shipped(self, modules: set[str] | None = None) -> bytes:
        """What travels to workers: the app without its cluster connection or model, its class by value when it
        is defined in the script. ``modules`` receives the local modules (beside the script) it refers to, which
        the workers need before they can load it (the training run ships them)."""
        clone = copy.copy(self)
        clone.cluster = None  # type: ignore[assignment]
        clone.model = None
        return serialization.dumps_inline(clone, modules)

    def _seed_and_build(self, seed: int) -> None:
        """Seed the process's random generators with the run's ``seed`` and, if the app has no model yet, create
        it (its initial weights drawn from them): one app at a time, so that apps trained from threads at once
        do not interleave their draws (each gets the weights its seed gives alone)."""
        with _SEEDING:
            seeded = set_random_seed(seed)
            if self.model is None:
                model = self.create_model()
                if keras_loaded_since(seeded):  # its import drew from the seeded generator: built again, as the
                    set_random_seed(seed)  # next run in this process builds it (the same seed, the same weights)
                    model = self.create_model()
                if not (hasattr(model, "get_weights") and hasattr(model, "set_weights")):
                    raise ConfigTypeError(
                        f"{type(self).__name__}.create_model() must return a compiled Keras model or a "
                        f"ddlf.models.TorchModel, not {type(model).__name__}"
                    )
                self.model = model

    def _build_from_workers(self, infos: list[dict[str, Any]], seed: int = 0) -> None:
        """A master's model that ``fit`` would build on its first batch (a subclassed model, a ``Sequential``
        without ``keras.Input``) is built from the inputs of the dataset's first rows, as the workers built theirs
        (:meth:`~.replica.registry.Sessions.setup`)."""
        if not model_spec.needs_build(self.model):
            return
        sample = next((i["first_inputs"] for i in infos if i.get("first_inputs") is not None), None)
        if sample is not None:
            with _SEEDING:  # its initial weights drawn from the run's seed, one app at a time
                set_random_seed(seed)
                model_spec.build_from(self.model, sample)

    def _run(
        self,
        loop: Any,
        cfg: TrainConfig,
        validation_data: Any,
        callbacks: Sequence[Any],
        initial_epoch: int,
        mode: str,
    ) -> History:
        state = self.__dict__.pop("_next_run", None) or RunState()  # train()'s, or an override's own call
        t_start = state.t0 = time.perf_counter()
        self._seed_and_build(cfg.run.seed)
        if isinstance(cfg.strategy, GradientAveraging):
            check_steppable(self.model, self._worker_count(cfg.run))
        resumed, state.resumed = state.resumed, None  # the run holds it from here
        if resumed is None and cfg.run.resume and cfg.run.checkpoint_dir:
            resumed = checkpoint.load(cfg.run.checkpoint_dir)
        if resumed is not None:
            sharded = isinstance(cfg.strategy, GradientAveraging) and cfg.strategy.shard_optimizer
            checkpoint.check_resumable(resumed, isinstance(cfg.strategy, GradientAveraging), sharded)
            if resumed.get("learning_rate") is not None:  # before the workers set up: they take the master's rate
                adapter_for(self.model).set_learning_rate(float(resumed["learning_rate"]))
        history = History()
        workers = list(cfg.run.workers) if cfg.run.workers is not None else None
        members = Members(
            self, state.run_id, cfg.run.seed, history, workers=workers, fit=cfg.fit, collective=_collective(cfg)
        )
        live = members.start()
        try:  # whatever fails before the run trains (a refusal, a callback): the workers forget the run
            if not live:
                live = members.wait_for_any(cfg.run.rejoin_timeout)
            infos = [members.info[self.cluster.addresses[i]] for i in live]
            shard_rows = [i["rows"] for i in infos]
            if self.sharded:
                rows = sum(shard_rows)
            else:
                sizes = set(shard_rows)
                if len(sizes) != 1:
                    raise DatasetError(f"workers loaded datasets of different sizes: {sorted(sizes)}")
                rows = members.rows = sizes.pop()
            if rows == 0:  # fit refuses empty data too
                raise DatasetError(
                    f"{type(self).__name__}.load_dataset returned no rows to train on"
                    + (" (after validation_split)" if cfg.fit.validation_split else "")
                )
            self._build_from_workers(infos, cfg.run.seed)
            mismatch = next((i["model_mismatch"] for i in infos if i.get("model_mismatch")), None)
            if mismatch:
                warnings.warn(mismatch, ModelChangeWarning, stacklevel=3)
                members.note("model_mismatch", reason=mismatch)
            if isinstance(cfg.strategy, GradientAveraging) and cfg.strategy.shard_optimizer:
                check_shardable(self.model)  # here, before any round: the workers' models are the master's
            self.stop_training = False
            history.params = {
                "epochs": cfg.epochs,
                "batch_size": cfg.batch_size,
                "mode": mode,
                "workers": self._worker_count(cfg.run),
                "samples": rows,
                "setup": infos,
                "compression": cfg.compression,
                "exchange": "allreduce" if cfg.ring is not None else "master",
                "averaging": cfg.averaging,
                "strategy": type(cfg.strategy).__name__,
                "strategy_reason": state.strategy_reason,
                "scale_learning_rate": cfg.scale_learning_rate,
                "bucket_cap_mb": cfg.gradients.bucket_cap_mb if cfg.gradients is not None else None,
                "shard_optimizer": bool(cfg.gradients is not None and cfg.gradients.shard_optimizer),
                "outer_optimizer": "nesterov" if cfg.outer() is not None else None,
                "run_id": state.run_id,  # what the workers' status and logs call this run
            }
            if resumed is not None:
                initial_epoch = max(initial_epoch, int(resumed["epochs_done"]))
                self.model.set_weights(resumed["weights"])
                checkpoint.restore_history(history, resumed["history"])
                checkpoint.restore_rng(resumed)
                states = dict(resumed["worker_states"])
                whole = next((s["optimizer_shard"] for s in states.values() if s.get("optimizer_shard")), None)
                if whole is not None:  # sharded optimizer state: every worker takes it, to cut its shard from
                    states.update({w: {"optimizer_shard": whole} for w in live if w not in states})
                targets = [w for w in live if w in states]
                # the run's rate, not the saved one (scaled): one written before checkpoints held the master's
                # rate keeps the saved one unless it was scaled
                keep = "learning_rate" in resumed or bool(resumed.get("scale_learning_rate"))
                if targets:
                    self.cluster.run_each(
                        remote.restore_state,
                        [(state.run_id, {**states[w], "keep_learning_rate": keep}) for w in targets],
                        workers=targets,
                    )
                where = str(checkpoint.path_in(cfg.run.checkpoint_dir or ""))
                members.note("resumed", epochs_done=initial_epoch, checkpoint=where)
            cbs = [KerasCallback(cb) if is_keras_callback(cb) else cb for cb in callbacks]
            if cfg.verbose:
                # as fit adds its bar only where the callbacks hold no ProgbarLogger, the user's bar replaces ddlf's
                if not any(is_progbar_logger(cb) for cb in callbacks):
                    cbs.insert(0, ProgressBar(cfg.epochs, rows))
                cached = sum(bool(i["cached"]) for i in infos)
                saved = sum(i["first_load_seconds"] for i in infos if i["cached"])
                print(
                    f"ddlf: {mode} training on {len(live)} workers, {rows} samples per epoch; "
                    f"dataset {self.dataset_key!r} cached on {cached}/{len(infos)} workers"
                    + (f" (saved {saved:.2f} s of loading)" if cached else "")
                    + (f"; resuming after epoch {initial_epoch}" if resumed is not None else "")
                    + f"; ready in {time.perf_counter() - t_start:.2f} s"
                )
            steps = -(-rows // max(1, len(live)) // cfg.batch_size)  # batches a worker trains per epoch
            history.params.update(steps=steps, verbose=cfg.verbose)  # as fit's
            for cb in cbs:
                cb.set_app(self)
                if isinstance(cb, KerasCallback):
                    cb.set_params({"epochs": cfg.epochs, "steps": steps, "verbose": cfg.verbose}, rows)
                cb.history = history
            adapter = adapter_for(self.model)
            adapter.forget_restored_epoch()  # as fit starts: a callback may set it (below)
            for cb in cbs:
                cb.on_train_begin()
            # keras.callbacks.BackupAndRestore restored the master's model from its backup and says where to resume,
            # as fit reads it; the workers start from the master's (restored) weights.
            restored = adapter.restored_epoch()
            if restored:
                initial_epoch = max(initial_epoch, restored)
                members.note("resumed", epochs_done=initial_epoch, checkpoint="keras.callbacks.BackupAndRestore")
            # As the next fit goes on from its model's optimizer, the workers start from the master's (the last run's,
            # or one loaded or restored with the model), unless ddlf's own checkpoint gave each worker its own.
            adopted = resumed is None and master_optimizer.push(self, cfg, state.run_id, live)
            run = TrainingRun(
                app=self,
                cfg=cfg,
                state=state,
                history=history,
                callbacks=cbs,
                members=members,
                rows=rows,
                shard_rows=shard_rows,
                initial_epoch=initial_epoch,
                validation_data=validation_data,
                resumed=resumed,
                resume_position=int(resumed.get("epoch_position", 0)) if resumed is not None else 0,
                optimizer_adopted=adopted,
            )
        except BaseException:
            with contextlib.suppress(Exception):
                members.abandon()
            raise
        catching = cfg.run.preemption_signals if cfg.run.checkpoint_dir else ()
        try:
            # The master's long-lived objects out of the collector's full scans while the epochs run (process.py)
            with Preemption(catching) as run.preemption, frozen_heap():
                loop(run)
            if not run.optimizer_pulled:
                master_optimizer.pull(run)  # the master's model ends as fit leaves it: its optimizer stepped
        except BaseException:
            if cfg.run.report:  # the report of a failed run helps; failing to write it must not hide why it failed
                with contextlib.suppress(Exception):
                    write_report(history, cfg.run.report)
            raise
        finally:
            members.close()
            with contextlib.suppress(Exception):  # a lost worker must not hide the real error
                self.cluster.call(
                    remote.teardown, (state.run_id,), workers=members.candidates(), return_exceptions=True
                )
        if cfg.run.report:
            write_report(history, cfg.run.report)
        for cb in cbs:
            cb.on_train_end({"history": history.history})
        return history


def _collective(cfg: TrainConfig) -> bool:
    """Whether a run all-reduces worker to worker among several workers (a ring of one named worker waits on no
    other, so it need not take turns with another run: :class:`~ddlf.RingBusy`)."""
    return cfg.ring is not None and not (cfg.run.workers is not None and len(cfg.run.workers) == 1)
