"""The worker's side of training: one replica of the model per run, trained on the rows the master assigns.

The functions here are the endpoints the master calls by reference (``cluster.run_each(replica.train_reduce,
...)``; ddlf is installed on every worker, so only their arguments travel). Each finds the run's
:class:`~.session.Session` in this worker's :data:`~.sessions.SESSIONS` and hands it the typed round
(:mod:`ddlf.training.messages`). :mod:`.sessions` holds the runs, :mod:`.session` one run and its state,
:mod:`.rounds` and :mod:`.ring_rounds` the two kinds of round, :mod:`.steppers` the frameworks' compiled steps,
:mod:`.buckets` PyTorch's gradient buckets, :mod:`.state` a model's optimizer and random state, :mod:`.dataset`
its data and batches, :mod:`.evaluation` evaluation and prediction over its rows, and :mod:`.warm` the models kept
warm between runs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ...worker import services
from ...worker.drain import refuse_new_work, round_started
from ..messages import GradientRound, MasterRound, RingRound
from . import evaluation
from .registry import SESSIONS

# The daemon's settings (--max-runs, --run-idle-timeout, where runs are reported), Cluster.reset and a stop's
# wait for runs reach the sessions through the daemon's registry: the daemon never imports training.
services.register("training", busy=SESSIONS.busy, reset=SESSIONS.reset, configure=SESSIONS.configure)


def setup(
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
    """Set run ``run_id`` up on this worker (:meth:`.sessions.Sessions.setup`)."""
    refuse_new_work("run")  # a worker told to stop (SIGTERM) takes no new work: ddlf.worker.drain
    return SESSIONS.setup(worker, run_id, app_blob, seed, backend, torch, fit_blob, spec_blob, collective)


def touch(run_id: str) -> None:
    """The master of run ``run_id`` is alive (its keepalive, :meth:`~..membership.Members.start`): the run counts
    as used now. Nothing if the run is not set up here."""
    session = SESSIONS.by_id.get(run_id)
    if session is not None:
        session.last_used = time.monotonic()


def teardown(worker: Any, run_id: str) -> None:
    """Forget run ``run_id`` here (its dataset stays cached)."""
    SESSIONS.teardown(worker, run_id)


def runs() -> list[dict[str, Any]]:
    """The training runs this worker serves."""
    return SESSIONS.runs()


def session_state(run_id: str) -> dict[str, Any]:
    """What run ``run_id`` carries here besides its weights, for a checkpoint (:meth:`.session.Session.state`)."""
    return SESSIONS.get(run_id).state()


def restore_state(run_id: str, state: dict[str, Any]) -> None:
    """Put back what :func:`session_state` returned."""
    SESSIONS.get(run_id).restore(state)


def optimizer_state(run_id: str) -> dict[str, Any]:
    """Run ``run_id``'s optimizer state here, for the master's model (:meth:`.session.Session.held_optimizer_state`)."""
    return SESSIONS.get(run_id).held_optimizer_state()


def adopt_optimizer_state(run_id: str, state: dict[str, Any]) -> None:
    """Start run ``run_id`` here from the master's optimizer state (:meth:`.session.Session.adopt_optimizer_state`)."""
    SESSIONS.get(run_id).adopt_optimizer_state(state)


def train_chunk(worker: Any, spec: MasterRound) -> dict[str, Any]:
    """A round through the master, or an asynchronous chunk."""
    round_started()  # refused while the worker drains; else a stop interrupts it (ddlf.worker.drain)
    return SESSIONS.get(spec.run_id).train_chunk(worker, spec)


def train_reduce(worker: Any, spec: RingRound) -> dict[str, Any]:
    """A model-averaging round on the ring."""
    round_started()  # refused while the worker drains; else a stop interrupts it (ddlf.worker.drain)
    with SESSIONS.using(spec.run_id) as session:
        return session.train_reduce(worker, spec)


def train_gradients(worker: Any, spec: GradientRound) -> dict[str, Any]:
    """A gradient-averaging round on the ring."""
    round_started()  # refused while the worker drains; else a stop interrupts it (ddlf.worker.drain)
    with SESSIONS.using(spec.run_id) as session:
        return session.train_gradients(worker, spec)


def evaluate(
    run_id: str, weights: list[np.ndarray] | None, part: tuple[int, int] | None, batch_size: int
) -> dict[str, Any]:
    """Evaluate ``weights`` on rows ``part`` of this worker's dataset (None: those ``validation_split`` holds
    out): :func:`.evaluation.evaluate`."""
    with SESSIONS.using(run_id) as session:
        return evaluation.evaluate(session, weights, part, batch_size)


def metric_results(run_id: str, state: list[np.ndarray]) -> dict[str, float]:
    """The metrics' results for the workers' metric states added up (:func:`.evaluation.metric_results`)."""
    return evaluation.metric_results(SESSIONS.get(run_id), state)


def metric_directions(run_id: str) -> dict[str, str]:
    """Whether each compiled metric is better higher or lower (:func:`.evaluation.metric_directions`)."""
    return evaluation.metric_directions(SESSIONS.get(run_id))


def predict(run_id: str, weights: list[np.ndarray] | None, part: tuple[int, int], batch_size: int) -> Any:
    """Predictions for rows ``part`` of this worker's dataset (:func:`.evaluation.predict`)."""
    with SESSIONS.using(run_id) as session:
        return evaluation.predict(session, weights, part, batch_size)


def reduced_weights(run_id: str, round_no: int | None = None) -> list[np.ndarray]:
    """The weights of the last round reduced here."""
    return SESSIONS.get(run_id).reduced_weights(round_no)


def replace_reduced_weights(run_id: str, round_no: int, weights: list[np.ndarray]) -> None:
    """The next round starts here from ``weights`` (:meth:`.session.Session.replace_reduced_weights`)."""
    SESSIONS.get(run_id).replace_reduced_weights(round_no, weights)


__all__ = [
    "adopt_optimizer_state",
    "evaluate",
    "metric_directions",
    "metric_results",
    "optimizer_state",
    "predict",
    "reduced_weights",
    "replace_reduced_weights",
    "restore_state",
    "runs",
    "session_state",
    "setup",
    "teardown",
    "touch",
    "train_chunk",
    "train_gradients",
    "train_reduce",
]
