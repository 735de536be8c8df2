"""The training runs a worker serves: one :class:`~.session.Session` per run id, admitted within the daemon's
limits.

Several runs (from several masters, or one master's concurrent trainings) share a daemon without seeing each
other's model, optimizer or weights in flight (the broadcast weights live under
:func:`~..messages.weights_var`). Their requests interleave on the daemon's interpreter thread. At most
``Limits.max_runs`` runs hold a daemon at once; a new run past it is refused with an error naming the runs there,
unless one of them has been idle for ``Limits.idle_seconds`` (its master died without tearing it down): that one
is evicted.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import NotFoundError, RingBusy, TooManyRuns
from ...frameworks import model_spec
from ...frameworks.adapter import adapter_for
from ...frameworks.console import quiet_start
from ...frameworks.keras_backend import follow_keras_backend, initial_weights_unsampled, keras_backend_default
from ...frameworks.seeding import set_random_seed
from ...frameworks.tensorflow_graphs import custom_gradients, forget_custom_gradients
from ...process import keep_free_memory, release_heap, return_free_memory
from ..messages import FitData, weights_var
from . import warm
from .dataset import check_model_data, first_batch, load, parts_of, training_rows
from .session import Session

log = logging.getLogger("ddlf.training")


@dataclass
class Limits:
    """How many training runs a daemon holds at once (``ddlf-worker --max-runs``), and after how long without a
    request a run counts as abandoned (``--run-idle-timeout``)."""

    max_runs: int = 4
    idle_seconds: float = 600.0


RING_GONE_SECONDS = 60.0
"""A run that all-reduces worker to worker and has had no request for this long is taken as gone by
:meth:`Sessions.ring_free`: a master killed mid-run does not hold a hand-started daemon's ring until the run limit
evicts it. A live master says it is alive every ``KEEPALIVE_SECONDS`` (:func:`~.touch`, from a thread of its own,
also while it validates or checkpoints), and a worker counts each request as used until it ends; a master frozen
for longer (a debugger) may find another ring run started beside its own."""


def _no_report(runs: list[str]) -> None:
    pass


class Sessions:
    """The runs set up on this worker, by run id."""

    def __init__(self) -> None:
        self.limits = Limits()
        self.by_id: dict[str, Session] = {}
        self.report_runs: Callable[[list[str]], None] = _no_report
        """Where the list of runs goes whenever it changes (the daemon's status, answered without this
        interpreter)."""
        self._gradients_before: set[str] | None = None
        """TensorFlow's custom gradients registered before the first of the runs now held: those the runs add
        are forgotten when the last is torn down (:mod:`ddlf.frameworks.tensorflow_graphs`)."""

    def configure(
        self,
        *,
        max_runs: int | None = None,
        idle_seconds: float | None = None,
        report_runs: Callable[[list[str]], None] | None = None,
    ) -> None:
        """Set by the daemon that hosts the replicas (``ddlf-worker``): its limits and where runs are reported."""
        if max_runs is not None:
            self.limits.max_runs = max_runs
        if idle_seconds is not None:
            self.limits.idle_seconds = idle_seconds
        if report_runs is not None:
            self.report_runs = report_runs

    def get(self, run_id: str) -> Session:
        """The session of ``run_id``, marked used now."""
        session = self.by_id.get(run_id)
        if session is None:
            raise NotFoundError(
                f"training run {run_id} is not set up on this worker (it was torn down, or evicted after "
                f"{self.limits.idle_seconds:.0f} s idle)"
            )
        session.last_used = time.monotonic()
        return session

    @contextlib.contextmanager
    def using(self, run_id: str) -> Iterator[Session]:
        """The session of ``run_id`` (:meth:`get`) for a call that may be long (a ring round, an evaluation, a
        prediction): used until the call ends too, however it ends, so that :meth:`ring_free` never takes a run
        busy in one for a run whose master is gone."""
        session = self.get(run_id)
        try:
            yield session
        finally:
            session.last_used = time.monotonic()

    def setup(
        self,
        worker: Any,
        run_id: str,
        app_blob: bytes,
        seed: int,
        backend: str | None = None,
        torch: bool | None = None,
        fit_blob: bytes | None = None,
        spec_blob: bytes | None = None,
        collective: bool = False,
    ) -> dict[str, Any]:
        """Load (or reuse) the app's dataset and build its model on this worker, on the master's Keras
        ``backend``. ``torch``: the master's model is a ``TorchModel`` or Keras runs on torch (None: as far as this
        worker can tell, :func:`~ddlf.frameworks.seeding.uses_torch`). ``fit_blob``: the run's pickled
        :class:`~..messages.FitData` (``train``'s data arguments; None: ``fit``'s defaults). ``spec_blob``: the master's
        model beyond its weights (:mod:`ddlf.frameworks.model_spec`), which the model built here is made to agree with
        before anything else uses it (None: nothing to agree with). ``collective``: the run all-reduces worker to
        worker, which one other such run here would deadlock (:meth:`ring_free`)."""
        import cloudpickle

        if collective:
            self.ring_free(worker, run_id)  # before any loading: a refused master asks again

        if torch:
            from ...frameworks.loading import load_torch_compiler_first

            load_torch_compiler_first()  # before anything loads TensorFlow: the app's unpickling may
        if backend:
            follow_keras_backend(backend)
        else:
            keras_backend_default()
        with quiet_start():  # the app's module may import a framework: its start-up notices go to the log
            app = cloudpickle.loads(app_blob)
            fit = cloudpickle.loads(fit_blob) if fit_blob is not None else FitData()
            spec = cloudpickle.loads(spec_blob) if spec_blob is not None else None
        t0 = time.perf_counter()
        keep_free_memory()  # a run starts: the heap the last one left stays for this one's transfers
        if not self.by_id and self._gradients_before is None:
            self._gradients_before = custom_gradients()
        worker_seed = seed + 1000 * (worker.id + 1)
        set_random_seed(worker_seed, torch=torch)
        n_shards = worker.n_workers if app.sharded else 0
        identity = hashlib.sha256(app_blob).digest()
        item, cached = load(app, identity, worker.id if n_shards else None, n_shards)
        parts = parts_of(item.value, fit)
        rows = training_rows(parts.rows, fit)
        # the master's weights overwrite the initial ones before any use: on JAX they are not sampled (compiles)
        with initial_weights_unsampled() as unsampled:
            with model_spec.building_as(spec):  # under the master's global dtype policy
                model = app.create_model()
            if adapter_for(model).seeds_torch:
                set_random_seed(worker_seed, torch=True)  # torch may have been imported by create_model itself
            sample, first_y = first_batch(parts, app.preprocess)
            check_model_data(sample, first_y, type(app).preprocess.__qualname__ != "IApp.preprocess")
            if sample is not None and model_spec.needs_build(model):  # built on its first batch, as fit builds it
                model_spec.build_from(model, sample)
            else:
                sample = None  # the master needs no inputs to build its model from
        unsampled.sample_outside(model)  # what the master's weights do not overwrite is sampled after all
        # The master's model is the truth: what the user changed on it since create_model() (a recompile, trainable
        # flags, a learning rate, an adapted layer) is made so here too, before a warm model is looked up by it.
        changes = model_spec.apply(model, spec)
        mismatch = model_spec.differs(model, spec)
        if changes:
            log.info("training run %s: the model built here took the master's %s", run_id, ", ".join(changes))
        self.admit(worker, run_id)
        # an earlier run's traced model (for data of the same shapes), holding this one's initial state
        model, stepper, key = warm.lend(model, warm.data_signature(app, parts, fit))
        self.by_id[run_id] = Session(
            run_id,
            app,
            model,
            parts,
            rows,
            fit,
            n_shards,
            collective=collective,
            stepper=stepper,
            warm_key=key,
            identity=identity,
        )
        self.publish()
        name = type(app).__name__
        log.info("training run %s (%s) set up: %d rows, %d runs here", run_id, name, rows, len(self.by_id))
        return {
            "rows": rows,
            "validation_rows": parts.rows - rows,
            "cached": cached,
            "load_seconds": 0.0 if cached else item.load_seconds,
            "first_load_seconds": item.load_seconds,
            "setup_seconds": time.perf_counter() - t0,
            "model_changes": changes,
            "model_mismatch": mismatch,  # the master warns (ModelChangeWarning)
            "first_inputs": sample,  # a model built on its first batch: the master builds its own from them
        }

    def admit(self, worker: Any, run_id: str) -> None:
        """Make room for ``run_id``: evict runs idle past the limit when the daemon is full, else refuse."""
        held_runs, limits = self.by_id, self.limits
        if run_id in held_runs or len(held_runs) < limits.max_runs:
            return
        now = time.monotonic()
        for other, s in sorted(held_runs.items(), key=lambda kv: kv[1].last_used):
            if now - s.last_used >= limits.idle_seconds:
                idle = now - s.last_used
                log.warning("training run %s evicted: idle for %.0f s, and run %s needs its place", other, idle, run_id)
                self.teardown(worker, other)
                if len(held_runs) < limits.max_runs:
                    return
        held = ", ".join(
            f"{rid} ({type(s.app).__name__}, idle {now - s.last_used:.0f} s)" for rid, s in sorted(held_runs.items())
        )
        raise TooManyRuns(
            f"this worker already serves {len(held_runs)} training runs (--max-runs {limits.max_runs}): {held}; "
            f"runs idle for {limits.idle_seconds:.0f} s are evicted"
        )

    def ring_free(self, worker: Any, run_id: str) -> None:
        """Refuse ``run_id``, which all-reduces worker to worker, while another such run holds this daemon
        (:class:`~ddlf.RingBusy`): a worker runs one call at a time, so two runs whose rounds wait on each other's
        workers would each hold up the round the other waits for (worker 0 in run A's, worker 1 in run B's). One
        whose master is gone (:data:`RING_GONE_SECONDS`) is not waited for."""
        now = time.monotonic()
        for other, s in sorted(self.by_id.items()):
            if other == run_id or not s.collective:
                continue
            idle = now - s.last_used
            if idle >= RING_GONE_SECONDS:
                # Its master's keepalive has not come for this long (nor any request, each counted as used until it
                # ends): the master is gone, killed most likely. Kept (the run limit may evict it), not waited for.
                said = "training run %s: no request for %.0f s, taken as gone; run %s may use the ring"
                log.warning(said, other, idle, run_id)
                continue
            raise RingBusy(
                f"training run {other} ({type(s.app).__name__}, idle {idle:.0f} s) all-reduces worker to worker "
                f"on this worker; run {run_id} would too, and two such runs on the same workers would wait on each "
                "other: it waits for that one to end"
            )

    def runs(self) -> list[dict[str, Any]]:
        """The training runs this worker serves: id, app class, rows, seconds since start and since last use."""
        now, wall = time.monotonic(), time.time()
        return [
            {
                "run_id": rid,
                "app": type(s.app).__name__,
                "rows": s.rows,
                "running_for_s": wall - s.started,
                "idle_s": now - s.last_used,
            }
            for rid, s in sorted(self.by_id.items())
        ]

    def teardown(self, worker: Any, run_id: str) -> None:
        """Forget a run's session and its broadcast weights (the dataset stays cached)."""
        session = self.by_id.pop(run_id, None)
        if session is not None:
            warm.keep(session.warm_key, session.model, session.stepper)
            if session.heap_holder is not None:
                release_heap(session.heap_holder)  # the run's cycles can be collected
            log.info("training run %s torn down", run_id)
            self.publish()
        worker.vars.pop(weights_var(run_id), None)
        if session is not None and not self.by_id:
            return_free_memory(wait=False)  # idle: what the allocator keeps for transfers goes back, unless a run comes
        if not self.by_id and self._gradients_before is not None:
            # no run is tracing: the graphs the runs traced need their gradients' registrations no more
            forgotten = forget_custom_gradients(keep=self._gradients_before)
            self._gradients_before = None
            if forgotten:
                log.debug("forgot %d traced custom gradients of finished runs", forgotten)

    def busy(self) -> list[str]:
        """The runs held here, described for a refused reset: id, app, idle seconds."""
        now = time.monotonic()
        return [
            f"{rid} ({type(s.app).__name__}, idle {now - s.last_used:.0f} s)" for rid, s in sorted(self.by_id.items())
        ]

    def reset(self, worker: Any) -> dict[str, Any]:
        """Tear every run down and drop the warm models (``Cluster.reset``)."""
        runs = sorted(self.by_id)
        for run_id in runs:
            self.teardown(worker, run_id)
        return {"runs": runs, "warm_models": warm.drop_all()}

    def publish(self) -> None:
        """Report the runs held here to the daemon."""
        self.report_runs([f"{rid} {type(s.app).__name__}" for rid, s in sorted(self.by_id.items())])


SESSIONS = Sessions()
"""This worker's runs."""
