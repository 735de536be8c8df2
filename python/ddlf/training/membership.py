"""Which workers take part in a training run, and bringing workers into it: at the start, after they were
lost and came back, after their daemon restarted, or when they were added with ``cluster.add_worker``.

A worker takes part once it has been set up for the run (its dataset loaded or found in its store, its model
built). Set-up is tracked by address and daemon instance, so a restarted daemon is set up again.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from typing import Any

from ..errors import DatasetError, DdlfError, RemoteError, RingBusy, WorkerUnavailable
from ..frameworks import model_spec
from ..frameworks.keras_backend import keras_backend_in_use
from ..frameworks.seeding import uses_torch
from ..serialization import dumps_inline
from . import replica as remote
from .policy import stopping

log = logging.getLogger("ddlf.training")

KEEPALIVE_SECONDS = 10.0
"""How often the master of a run that all-reduces worker to worker tells its workers that it is alive (a worker
takes such a run as gone after ``replica.registry.RING_GONE_SECONDS`` without a word)."""

_BACKOFF = random.SystemRandom()  # not the process's generator, which the run seeds: two masters would wait in step

PROBE_TIMEOUT = 1.0  # seconds a reconnection attempt to a lost worker waits for it
PROBE_GRACE = 0.05  # seconds a round waits for that attempt before going on without the worker


class Members:
    """The live, set-up workers of one run."""

    def __init__(
        self,
        app: Any,
        run_id: str,
        seed: int,
        history: Any,
        rejoin_interval: float = 1.0,
        workers: list[int] | None = None,
        fit: Any = None,
        collective: bool = False,
    ) -> None:
        self.app = app
        self.collective = collective  # the run all-reduces worker to worker: a worker may refuse it (RingBusy)
        self.cluster = app.cluster
        self.run_id = run_id
        self.seed = seed
        self.history = history
        self.rejoin_interval = rejoin_interval
        self.modules: set[str] = set()  # local modules the app refers to: shipped before each setup
        self.blob = app.shipped(self.modules)
        # train's data arguments (class weights, a sample-weight function by value), sent with each set-up
        self.fit_blob = dumps_inline(fit, self.modules) if fit is not None and not fit.plain else None
        # What the master's model is beyond its weights (compile, trainable flags, preprocessing state, torch's
        # optimizer groups): each worker's create_model() result is made to agree with it (frameworks.model_spec)
        self.spec_blob = dumps_inline(model_spec.describe(app.model), self.modules)
        self.backend = keras_backend_in_use()  # workers run the master's Keras backend
        # Workers load PyTorch's compiler before TensorFlow only for a run that needs it (ddlf.frameworks.loading).
        self.torch = uses_torch(app.model)
        self.only = set(workers) if workers is not None else None  # a subset of the cluster's workers
        self.rows = 0  # rows every worker must hold (whole-dataset runs), once the first ones are set up
        self.ready: dict[str, int] = {}  # address -> daemon instance set up for this run
        self.stopping: dict[str, int] = {}  # address -> daemon instance that said it is stopping (SIGTERM)
        self.info: dict[str, dict[str, Any]] = {}
        self.epoch = 0
        self.round = 0
        self._last_recover = 0.0
        self._probe: threading.Thread | None = None  # the reconnection attempt in flight, if any
        self._lock = threading.Lock()
        self._seen_events = len(self.cluster.events)
        self._alive = threading.Event()  # set: the keepalive stops
        self._keepalive: threading.Thread | None = None

    def note(self, event: str, **fields: Any) -> None:
        """Record a training event in History."""
        self.history.events.append(
            {"time": time.time(), "event": event, "epoch": self.epoch, "round": self.round, **fields}
        )

    def _sync_events(self) -> None:
        """Copy the cluster's new fault events into History, stamped with the epoch and round."""
        for e in self.cluster.events[self._seen_events :]:
            self.history.events.append({**e, "epoch": self.epoch, "round": self.round})
        self._seen_events = len(self.cluster.events)

    def live(self, *, first: bool = False) -> list[int]:
        """Indices of the workers that take part now. Lost workers are retried (at most every
        ``rejoin_interval`` seconds) and every live worker not yet set up for this run is set up first."""
        with self._lock:
            c = self.cluster
            if c.closed:  # not "every worker is lost" after the rejoin timeout: nothing will come back
                raise DdlfError("this cluster is closed")
            self._probe_lost()
            self._sync_events()
            need = [i for i in self.candidates() if self.ready.get(c.addresses[i]) != c.instance(i)]
            need = [i for i in need if self.stopping.get(c.addresses[i]) != c.instance(i)]
            if need:
                if self.modules:
                    c._ship(self.modules, None)
                args = (self.run_id, self.blob, self.seed, self.backend, self.torch, self.fit_blob, self.spec_blob)
                outcomes = c.call(remote.setup, (*args, self.collective), workers=need, return_exceptions=True)
                busy: list[str] = []
                for i, out in zip(need, outcomes):
                    if stopping(out):
                        self.stopped(out)  # told to stop (ddlf.worker.drain): not asked again
                        continue
                    if isinstance(out, WorkerUnavailable):
                        continue  # lost while being set up: marked by the cluster, retried later
                    if isinstance(out, RemoteError) and out.raised("RingBusy"):
                        busy.append(f"worker {i} ({c.addresses[i]}): {out.remote_message}")
                        if not first:  # came back, but another run's ring took it meanwhile: asked again later
                            self.note("ring_busy", worker=i, address=c.addresses[i], reason=out.remote_message)
                        continue
                    if isinstance(out, BaseException):
                        raise out
                    address = c.addresses[i]
                    self._check_rows(i, out)
                    self.ready[address] = c.instance(i)
                    self.info[address] = out
                    if not first:
                        self.note("joined", worker=i, address=address)
                if busy and first:
                    raise RingBusy("; ".join(busy))
            self._sync_events()
            ready = [i for i in self.candidates() if self.ready.get(c.addresses[i]) == c.instance(i)]
            return [i for i in ready if self.stopping.get(c.addresses[i]) != c.instance(i)]

    def start(self) -> list[int]:
        """Set the run up on its workers (:meth:`live`). While another run that all-reduces worker to worker holds
        one of them (:class:`~ddlf.RingBusy`: two would deadlock on each other's rounds), tear down, wait and ask
        again: runs started at once take turns. Any other refusal tears the run down on every worker, and raises."""
        attempt = 0
        while True:
            attempt += 1
            try:
                live = self.live(first=True)
                if self.collective and self._keepalive is None:
                    self._keepalive = threading.Thread(target=self._keep_alive, name="ddlf-keepalive", daemon=True)
                    self._keepalive.start()
                return live
            except RingBusy as busy:
                with contextlib.suppress(Exception):
                    self.abandon()
                if attempt == 1:
                    log.warning("training run %s waits for its workers: %s", self.run_id, busy)
                # Random, growing waits: two runs refused on each other's workers do not ask again in step.
                time.sleep(_BACKOFF.uniform(0.1, 0.5) * min(attempt, 10))
            except BaseException:  # Ctrl-C during a set-up too: nothing of the run stays on the workers
                # a worker refused the set-up (its data, its model): the others that set the run up forget it too
                with contextlib.suppress(Exception):
                    self.abandon()
                raise

    def _keep_alive(self) -> None:
        """Tell the run's workers every :data:`KEEPALIVE_SECONDS` that this master is alive, until :meth:`close`."""
        while not self._alive.wait(KEEPALIVE_SECONDS):
            with contextlib.suppress(Exception):  # a lost worker is the run's business, not the keepalive's
                self.cluster.call(remote.touch, (self.run_id,), workers=self.candidates(), return_exceptions=True)

    def abandon(self) -> None:
        """Tear the run down on its workers before it trains (refused, or waiting its turn): nothing of it stays
        there, and every worker is set up again if it is asked for."""
        if self._keepalive is not None:
            self._alive.set()
        with self._lock:
            self.ready.clear()
            self.info.clear()
            self.rows = 0
        self.cluster.call(remote.teardown, (self.run_id,), workers=self.candidates(), return_exceptions=True)

    def _probe_lost(self) -> None:
        """Try to reconnect the lost workers, at most every ``rejoin_interval`` seconds, off the round's path: a
        worker that answers at once (a daemon restarted, a link back) is set up for this round, while one that
        is stopped or unreachable costs at most ``PROBE_GRACE`` seconds per attempt, not the attempt's whole
        timeout in every round."""
        c = self.cluster
        if self._probe is not None and self._probe.is_alive():
            return  # still waiting for an unresponsive worker: the round goes on without it
        if not c.lost_workers or time.monotonic() - self._last_recover < self.rejoin_interval:
            return
        self._last_recover = time.monotonic()
        probe = self._probe = threading.Thread(target=self._recover, name="ddlf-rejoin-probe", daemon=True)
        probe.start()
        probe.join(PROBE_GRACE)

    def _recover(self) -> None:
        with contextlib.suppress(Exception):  # what failed stays lost; the next probe tries again
            self.cluster.recover(timeout=PROBE_TIMEOUT)

    def close(self) -> None:
        """The run is over: wait for a reconnection attempt in flight (at most its timeout), so that what it
        finds is recorded before the run's History is returned and nothing of the run outlives it."""
        self._alive.set()
        probe = self._probe
        if probe is not None:
            probe.join()
            self._sync_events()

    def holding_state(self) -> list[int]:
        """The workers whose session of this run holds its state: the live ones and those stopping (which still
        answer while they drain), for a checkpoint."""
        c = self.cluster
        return [i for i in self.candidates() if self.ready.get(c.addresses[i]) == c.instance(i)]

    def stopped(self, exc: BaseException) -> None:
        """A worker answered that it is stopping (``exc``; SIGTERM: :mod:`ddlf.worker.drain`): it takes part in no
        further round of this run (a daemon started again in its place does)."""
        c = self.cluster
        address = getattr(exc, "address", None)
        if not isinstance(address, str) or address not in c.addresses:
            return
        i = c.addresses.index(address)
        if self.stopping.get(address) != c.instance(i):
            self.stopping[address] = c.instance(i)
            self.note("stopping", worker=i, address=address)

    def candidates(self) -> list[int]:
        """The cluster's live workers this run may use."""
        live = self.cluster.live_workers
        return live if self.only is None else [i for i in live if i in self.only]

    def _check_rows(self, i: int, info: dict[str, Any]) -> None:
        app = self.app
        if app.sharded or not self.rows:
            return
        if info["rows"] != self.rows:
            raise DatasetError(
                f"worker {i} ({self.cluster.addresses[i]}) loaded {info['rows']} rows; the others {self.rows}"
            )

    def wait_for_any(self, timeout: float, *, waited: float = 0.0) -> list[int]:
        """Every worker is lost: keep trying to bring one back for up to ``timeout`` seconds (``waited``: how
        long the caller has already waited, counted in the error)."""
        deadline = time.monotonic() + timeout
        while True:
            live = self.live()
            if live:
                return live
            if time.monotonic() >= deadline:
                lost = ", ".join(self.cluster.addresses)
                within = timeout + waited
                raise WorkerUnavailable(f"every worker is lost ({lost}) and none came back within {within:.0f} s")
            time.sleep(min(self.rejoin_interval, 0.5))
