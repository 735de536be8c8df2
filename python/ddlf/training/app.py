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
    history = MnistApp(cluster).train(epochs=10, batch_size=64, mode="sync")
```
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import data as datasets
from .. import serialization
from ..cluster.cluster import Cluster
from ..data.images import EncodedImages
from ..frameworks.keras_backend import keras_backend_default
from ..frameworks.seeding import set_random_seed
from ..report.training import check_report_path, write_report
from . import checkpoint
from . import replica as remote
from .asynchronous import train_async as _train_async
from .callbacks import Callback, ProgressBar
from .exchange import choose as choose_exchange
from .history import History
from .membership import Members
from .options import TrainConfig
from .policy import FailurePolicy
from .run import TrainingRun
from .synchronous import train_sync as _train_sync


class IApp:
    """A distributed training application.

    Subclasses implement :meth:`load_dataset` (runs once on each worker, result cached in the worker's dataset
    store under :attr:`dataset_key`) and :meth:`create_model` (a compiled Keras model; runs on the master and on
    every worker). Optionally :meth:`preprocess` turns each raw batch into model inputs on the worker, so the store
    can keep compact raw data (uint8 images) and convert per batch.
    """

    dataset_key: str | None = None
    """Worker-side cache key of the dataset; defaults to the class's qualified name."""

    sharded: bool = False
    """Set by apps whose dataset is larger than one worker: each worker then loads only its shard with
    :meth:`load_shard`, and shuffling happens within each shard."""

    def __init__(self, cluster: Cluster) -> None:
        keras_backend_default()  # the master builds the model too: the same backend as its workers
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
        raise NotImplementedError

    def create_model(self) -> Any:
        """Return a compiled Keras model (any backend), or a ``ddlf.models.TorchModel`` wrapping a torch module.
        Runs on the master and on every worker."""
        raise NotImplementedError

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
        batch_size: int = 32,
        mode: str = "sync",
        *,
        seed: int = 0,
        averaging_frequency: int | None = None,
        average_optimizer_state: bool = False,
        shuffle: str = "indices",
        worker_shares: Sequence[float] | None = None,
        rotate_shards_every: int | None = None,
        compression: str | None = None,
        topk_ratio: float = 0.01,
        prefetch: int = 2,
        staleness: str = "none",
        max_staleness: int | None = None,
        validation_data: tuple[Any, Any] | None = None,
        callbacks: Sequence[Callback] = (),
        verbose: int = 1,
        initial_epoch: int = 0,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        resume: bool = False,
        rejoin_timeout: float = 60.0,
        report: str | os.PathLike[str] | None = None,
        failure_policy: FailurePolicy | None = None,
        workers: Sequence[int] | None = None,
        exchange: str | None = None,
        hierarchical: bool | None = None,
        nonfinite: str = "skip",
        averaging: str = "weights",
        scale_learning_rate: bool = False,
        warmup_epochs: float = 0.0,
        bucket_cap_mb: float | None = 25.0,
        outer_optimizer: str | None = None,
        outer_learning_rate: float = 0.7,
        outer_momentum: float = 0.9,
        _slow_worker: tuple[int, float] | None = None,
    ) -> History:
        """Train on the cluster; returns a Keras-like :class:`~ddlf.History`.

        Args:
            mode: ``"sync"`` (parameter averaging) or ``"async"`` (each worker at its own pace).
            averaging_frequency: batches per round. Sync: default one whole partition (one round per epoch).
                Async: batches per chunk (default 10).
            average_optimizer_state: sync only: also average the optimizer state (Adam moments) each round.
            shuffle: ``"indices"`` (the master sends each worker its index partition) or ``"seeded"`` (the master
                sends only the seed and epoch; workers regenerate the same partition).
            worker_shares: relative amount of data per worker (for workers of unequal speed).
            rotate_shards_every: sharded apps: every k epochs each worker moves on to the next worker's shard, so
                that every worker eventually sees all the data.
            compression: ``None``, ``"float16"`` or ``"bfloat16"`` (workers send back deltas in half precision;
                on the ring, every link carries the round's changes or, with ``averaging="gradients"``, the
                gradients at half precision, summed in float32; a hierarchical ring sums a host's workers in
                float32 through shared memory and rounds only what crosses the network between hosts), or
                ``"topk"`` (master exchange only): workers send only the ``topk_ratio`` share of delta entries of
                largest magnitude, keeping the rest as error feedback for their next round (nothing is lost, only
                delayed). ``"bfloat16"`` keeps
                float32's range; ``"float16"`` is more precise but overflows past 65504 (such an update is
                skipped on every worker and reported).
            staleness, max_staleness: async staleness control (``"dynsgd"`` scales a delta by 1/(staleness+1)).
            validation_data: ``(x, y)`` evaluated on the master's model after each epoch (``val_*`` metrics).
            checkpoint_dir: write a checkpoint there after every epoch, atomically (weights, optimizer states,
                random states, epoch, History; see :mod:`ddlf.training.checkpoint`).
            resume: continue from the checkpoint in ``checkpoint_dir`` if there is one (a fresh start if not).
                In sync mode the resumed run ends with the same weights as an uninterrupted one.
            rejoin_timeout: when every worker is lost, how long to wait for one to come back before raising.
            report: write a self-contained HTML training report there when training ends (or fails): learning
                curves, a per-worker timeline of every round, where the time went, bytes on the wire, staleness
                and faults; its numbers go beside it as JSON (``run.html`` -> ``run.json``). See
                :mod:`ddlf.report`.
            failure_policy: what a worker's failure does (:class:`ddlf.FailurePolicy`): by default a lost worker
                is left out and taken back when it returns, and an exception in user code stops training.
            workers: train on these workers of the cluster only (indices). Runs are isolated on their workers
                (each has its own model, optimizer and weights in flight there, under its run id), so one master
                can train several apps at once on disjoint groups, from threads or asyncio, and several masters
                can share daemons (each daemon serves up to ``ddlf-worker --max-runs`` runs at once).
            exchange: sync only: how a round's workers agree on the averaged weights. ``"master"`` (the master
                broadcasts and averages; the default for ``averaging="weights"``), ``"allreduce"`` (the workers
                average among themselves over a ring, worker to worker: each sends ``2(n-1)/n`` times the weights
                per round whatever the cluster size, and the master carries no weights per round; the default and
                the only choice for ``averaging="gradients"``), or ``"auto"`` (all-reduce when the workers span
                several hosts). See :mod:`ddlf.training.exchange`.
            hierarchical: with the all-reduce: workers on one host reduce through shared memory and one per host
                joins the ring between hosts (see :meth:`ddlf.Cluster.ring`); default: when some host runs more
                than one of the workers. ``False``: one flat ring.
            averaging: sync only. ``"weights"`` (the paper's model averaging: each worker takes its own optimizer
                steps for ``averaging_frequency`` batches, then the weights are averaged) or ``"gradients"``
                (Horovod's and PyTorch DDP's: every step the workers average their batches' gradients over the
                ring and apply the same step, so ``n`` workers learn exactly like one process at ``n`` times the
                batch; see :mod:`ddlf.training.replica.steppers`). ``averaging_frequency`` then only sets how often the
                master checks in (progress, faults).
            scale_learning_rate: with ``averaging="gradients"``: multiply the compiled learning rate by the number
                of workers (the linear scaling rule of Goyal et al. 2017), since each step sees ``n`` times the
                batch. Use it when the per-worker ``batch_size`` is the one the learning rate was tuned for.
            warmup_epochs: reach the scaled learning rate linearly from the compiled one over this many epochs
                (step by step); large scale factors need a few epochs of warm-up to stay stable.
            bucket_cap_mb: with ``averaging="gradients"`` on PyTorch (Keras's torch backend, :class:`TorchModel`):
                the gradients go to the ring in buckets of about this many MB while the backward pass still runs
                (PyTorch DDP's ``bucket_cap_mb``, same default), so communication overlaps computation; ``None``
                exchanges them in one buffer after the backward pass. Keras on JAX and TensorFlow compute all
                gradients in one compiled call: they always exchange after it. See :mod:`ddlf.training.replica.buckets`.
            outer_optimizer: with model averaging (``averaging="weights"``, sync): ``"nesterov"`` applies each
                round's averaged change through Nesterov momentum (``outer_learning_rate``, ``outer_momentum``;
                DiLoCo's 0.7 and 0.9) instead of replacing the weights with the average, so workers can average
                much less often (a larger ``averaging_frequency``) at equal quality. Works with either exchange.
                See :mod:`ddlf.training.outer`.
            nonfinite: what a worker's reply holding NaN or infinity does: ``"skip"`` leaves it out of its round
                (a warning and a ``reply_refused`` event; the other workers' replies are merged) or ``"raise"``
                stops training with :class:`~ddlf.errors.NonFiniteUpdate`. Malformed replies (wrong count,
                shapes or dtypes of weights, ...) are always left out: see :mod:`ddlf.training.replies`.

        Lost workers never stop training (unless the failure policy says so): see :mod:`ddlf.training.synchronous` and
        :mod:`ddlf.training.asynchronous` for what happens to their rows, and ``history.events`` for what happened.
        """
        if resume and checkpoint_dir is None:
            raise ValueError("resume=True needs the checkpoint_dir to resume from")
        cfg = TrainConfig(
            epochs=epochs,
            batch_size=batch_size,
            seed=seed,
            averaging_frequency=averaging_frequency,
            average_optimizer_state=average_optimizer_state,
            shuffle=shuffle,
            shares=list(worker_shares) if worker_shares is not None else None,
            compression=compression,
            topk_ratio=topk_ratio,
            prefetch=prefetch,
            staleness=staleness,
            max_staleness=max_staleness,
            verbose=verbose,
            slow_worker=_slow_worker,
            rotate_shards_every=rotate_shards_every,
            checkpoint_dir=os.fspath(checkpoint_dir) if checkpoint_dir is not None else None,
            rejoin_timeout=rejoin_timeout,
            resume=resume,
            report=os.fspath(report) if report is not None else None,
            failure_policy=failure_policy if failure_policy is not None else FailurePolicy(),
            workers=self._subset(workers),
            exchange=exchange,
            hierarchical=hierarchical,
            nonfinite=nonfinite,
            averaging=averaging,
            scale_learning_rate=scale_learning_rate,
            warmup_epochs=warmup_epochs,
            bucket_cap_mb=bucket_cap_mb,
            outer_optimizer=outer_optimizer,
            outer_learning_rate=outer_learning_rate,
            outer_momentum=outer_momentum,
        )
        cfg.check()
        if cfg.shares is not None and len(cfg.shares) != len(self.cluster):
            raise ValueError(
                f"worker_shares has {len(cfg.shares)} entries for {len(self.cluster)} workers: give one per worker"
            )
        if cfg.report is not None:
            check_report_path(cfg.report)
        if rotate_shards_every is not None and not self.sharded:
            raise ValueError("rotate_shards_every needs a sharded app (sharded = True)")
        if mode == "async" and exchange not in (None, "master"):
            raise ValueError(
                f"exchange={exchange!r} is for mode='sync': asynchronous workers send their deltas to the master"
            )
        if mode == "async" and averaging != "weights":
            raise ValueError(
                f"averaging={averaging!r} is for mode='sync': asynchronous workers each step at their own pace"
            )
        if mode == "async" and outer_optimizer is not None:
            raise ValueError(
                "outer_optimizer is for mode='sync': it steps with each round's averaged change, and asynchronous "
                "training has no rounds"
            )
        if mode == "sync":
            # Decided (and refused) here, before any worker sets the run up.
            targets = cfg.workers if cfg.workers is not None else list(range(len(self.cluster)))
            cfg.exchange = choose_exchange(cfg.exchange, self.cluster, targets, cfg.compression, cfg.averaging)
            return self.train_sync(cfg, validation_data, callbacks, initial_epoch)
        if mode == "async":
            return self.train_async(cfg, validation_data, callbacks, initial_epoch)
        raise ValueError(f"mode must be 'sync' or 'async', not {mode!r}")

    def train_sync(
        self, cfg: TrainConfig, validation_data: Any = None, callbacks: Sequence[Callback] = (), initial_epoch: int = 0
    ) -> History:
        """Synchronous training (see :mod:`ddlf.training.synchronous`). Override to customise."""
        return self._run(_train_sync, cfg, validation_data, callbacks, initial_epoch, "sync")

    def train_async(
        self, cfg: TrainConfig, validation_data: Any = None, callbacks: Sequence[Callback] = (), initial_epoch: int = 0
    ) -> History:
        """Asynchronous training (see :mod:`ddlf.training.asynchronous`). Override to customise."""
        return self._run(_train_async, cfg, validation_data, callbacks, initial_epoch, "async")

    def evaluate(self, x: Any, y: Any, batch_size: int = 256, **kwargs: Any) -> Any:
        """Evaluate the master's model (``model.evaluate``), applying :meth:`preprocess` first. Encoded images
        (:class:`ddlf.datasets.EncodedImages`) are decoded batch by batch, never all at once."""
        verbose = kwargs.pop("verbose", 0)
        if isinstance(x, EncodedImages):
            batches = datasets.batches([x, y], batch_size=batch_size, preprocess=self.preprocess)
            steps = -(-len(x) // batch_size)
            return self.model.evaluate(batches, steps=steps, verbose=verbose, **kwargs)
        x, y = self.preprocess(x, y)
        return self.model.evaluate(x, y, batch_size=batch_size, verbose=verbose, **kwargs)

    # -- internals --------------------------------------------------------------------------------------

    def _subset(self, workers: Sequence[int] | None) -> list[int] | None:
        if workers is None:
            return None
        if isinstance(workers, (str, bytes)) or not all(
            isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in workers
        ):
            raise TypeError(f"workers must be a list of worker indices, not {workers!r}")
        subset = sorted({int(w) for w in workers})
        if not subset:
            raise ValueError("workers is empty: name at least one worker")
        bad = [w for w in subset if not 0 <= w < len(self.cluster)]
        if bad:
            raise IndexError(f"workers {bad} out of range: the cluster has {len(self.cluster)} workers")
        if self.sharded:
            raise ValueError("workers= needs a whole-dataset app: a sharded app trains on every worker's shard")
        return subset

    def validate(self, data: tuple[Any, Any]) -> dict[str, float]:
        """Evaluate the master's model on ``(x, y)`` (after :meth:`preprocess`): Keras's ``val_*`` logs."""
        out = self.evaluate(*data, batch_size=512, return_dict=True)
        return {f"val_{k}": float(v) for k, v in out.items()}

    def shipped(self, modules: set[str] | None = None) -> bytes:
        """What travels to workers: the app without its cluster connection or model, its class by value when it
        is defined in the script. ``modules`` receives the local modules (beside the script) it refers to, which
        the workers need before they can load it (the training run ships them)."""
        clone = copy.copy(self)
        clone.cluster = None  # type: ignore[assignment]
        clone.model = None
        return serialization.dumps_inline(clone, modules)

    def _run(
        self,
        loop: Any,
        cfg: TrainConfig,
        validation_data: Any,
        callbacks: Sequence[Callback],
        initial_epoch: int,
        mode: str,
    ) -> History:
        t_start = cfg.t0 = time.perf_counter()
        set_random_seed(cfg.seed)
        if self.model is None:
            self.model = self.create_model()
        resumed = checkpoint.load(cfg.checkpoint_dir) if cfg.resume and cfg.checkpoint_dir else None
        history = History()
        members = Members(self, cfg.run_id, cfg.seed, history, workers=cfg.workers)
        live = members.live(first=True)
        if not live:
            live = members.wait_for_any(cfg.rejoin_timeout)
        infos = [members.info[self.cluster.addresses[i]] for i in live]
        shard_rows = [i["rows"] for i in infos]
        if self.sharded:
            rows = sum(shard_rows)
        else:
            sizes = set(shard_rows)
            if len(sizes) != 1:
                raise ValueError(f"workers loaded datasets of different sizes: {sorted(sizes)}")
            rows = members.rows = sizes.pop()
        self.stop_training = False
        history.params = {
            "epochs": cfg.epochs,
            "batch_size": cfg.batch_size,
            "mode": mode,
            "workers": len(cfg.workers) if cfg.workers is not None else len(self.cluster),
            "samples": rows,
            "setup": infos,
            "compression": cfg.compression,
            "exchange": cfg.exchange if mode == "sync" else "master",
            "averaging": cfg.averaging,
            "bucket_cap_mb": cfg.bucket_cap_mb if cfg.averaging == "gradients" else None,
            "outer_optimizer": cfg.outer_optimizer,
            "run_id": cfg.run_id,  # what the workers' status and logs call this run
        }
        if resumed is not None:
            initial_epoch = max(initial_epoch, int(resumed["epochs_done"]))
            self.model.set_weights(resumed["weights"])
            checkpoint.restore_history(history, resumed["history"])
            checkpoint.restore_rng(resumed)
            states = resumed["worker_states"]
            targets = [w for w in live if w in states]
            if targets:
                self.cluster.run_each(remote.restore_state, [(cfg.run_id, states[w]) for w in targets], workers=targets)
            where = str(checkpoint.path_in(cfg.checkpoint_dir or ""))
            members.note("resumed", epochs_done=initial_epoch, checkpoint=where)
        cbs = list(callbacks)
        if cfg.verbose:
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
        for cb in cbs:
            cb.set_app(self)
            cb.history = history
            cb.on_train_begin()
        run = TrainingRun(
            app=self,
            cfg=cfg,
            history=history,
            callbacks=cbs,
            members=members,
            rows=rows,
            shard_rows=shard_rows,
            initial_epoch=initial_epoch,
            validation_data=validation_data,
            resumed=resumed,
        )
        try:
            loop(run)
        except BaseException:
            if cfg.report:  # the report of a failed run helps; failing to write it must not hide why it failed
                with contextlib.suppress(Exception):
                    write_report(history, cfg.report)
            raise
        finally:
            with contextlib.suppress(Exception):  # a lost worker must not hide the real error
                self.cluster.call(remote.teardown, (cfg.run_id,), workers=members.candidates(), return_exceptions=True)
        if cfg.report:
            write_report(history, cfg.report)
        for cb in cbs:
            cb.on_train_end({"history": history.history})
        return history
