"""Checkpoints of a training run, written atomically each epoch and read back by ``train(..., resume=True)``.

Checkpoints are pickles: load only those your own runs wrote (like any pickle, a crafted file runs code).

A checkpoint holds everything needed to continue as if nothing happened: the master's weights, the averaged
optimizer state (if any), each worker's own optimizer state, random-generator state and top-k residual, the
number of epochs done, the master's random state and the History so far. In sync mode a run interrupted and
resumed reaches the same weights as an uninterrupted one (tested).

The file is written next to its final name, flushed to disk, then renamed over it: a crash at any moment
leaves either the previous checkpoint or the new one, never a torn file. A write that fails (a full disk, a
quota, a read-only mount) removes its partial file and raises :class:`~ddlf.errors.CheckpointError`; the previous
checkpoint stays as it was.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, ConfigError
from .history import History, RoundStats

FILENAME = "ddlf-checkpoint.pkl"
FORMAT = 1


def path_in(directory: str | os.PathLike[str]) -> Path:
    """Where the checkpoint of ``directory`` lives."""
    return Path(directory) / FILENAME


def save(
    directory: str | os.PathLike[str],
    *,
    epochs_done: int,
    mode: str,
    seed: int,
    weights: list[np.ndarray],
    optimizer_state: list[np.ndarray] | None,
    worker_states: dict[int, Any],
    history: History,
    outer_state: list[np.ndarray] | None = None,
    position: int = 0,
    strategy: str | None = None,
    scale_learning_rate: bool | None = None,
    learning_rate: float | None = None,
) -> Path:
    """Write the checkpoint atomically; returns its path. ``position``: how far into epoch ``epochs_done`` the
    run got (the epoch plan's :meth:`position`, 0 at an epoch's end): a preempted run resumes there.
    ``strategy``: the run's strategy class name (:func:`check_resumable` reads it), and with gradient averaging
    ``scale_learning_rate``: whether it scaled the rate by the workers (a resumed run with no strategy given goes on
    as it was). ``learning_rate``: the master's plain (Keras) rate, as a callback may have left it (a resumed run
    trains on from it, as ``BackupAndRestore`` restores it)."""
    final = path_in(directory)
    state = {
        "format": FORMAT,
        "epochs_done": epochs_done,
        "epoch_position": position,
        "mode": mode,
        "strategy": strategy,
        "scale_learning_rate": scale_learning_rate,
        "learning_rate": learning_rate,
        "seed": seed,
        "weights": weights,
        "optimizer_state": optimizer_state,
        "worker_states": worker_states,
        "outer_state": outer_state,  # the outer optimizer's momentum (master exchange; the ring's is per worker)
        "rng": {"numpy": np.random.get_state(), "python": random.getstate()},
        "history": {
            "history": history.history,
            "epoch_seconds": history.epoch_seconds,
            "epoch": history.epoch,
            "stats": [asdict(s) for s in history.stats],
            "events": history.events,
        },
    }
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as exc:
        with contextlib.suppress(OSError):  # absent, or its directory could not be made
            tmp.unlink()  # a partial file would hold the space the next write needs
        previous = "the previous checkpoint there is intact" if final.exists() else "there is no earlier checkpoint"
        raise CheckpointError(
            exc.errno or 0,
            f"cannot write the checkpoint of epoch {epochs_done} to {final.parent}: {exc.strerror or exc}; "
            f"{previous}. Free space there (or pass another checkpoint_dir) and train again with resume=True",
            str(final),
        ) from exc
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)
    return final


def load(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The checkpoint in ``directory``, or None if there is none yet."""
    path = path_in(directory)
    if not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            state = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable ddlf checkpoint: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"{path} is not a ddlf checkpoint of format {FORMAT} (found {found!r})")
    return state


def check_resumable(saved: dict[str, Any], gradient_averaging: bool, sharded: bool = False) -> None:
    """Refuse to resume under gradient averaging a checkpoint another strategy wrote: its workers' optimizer
    states differ (each took its own steps), and gradient averaging keeps replicas identical only from identical
    states, so they would drift apart unnoticed. Checkpoints that do not name their strategy (written before it
    was recorded) are let through. Refuse too to resume sharded optimizer state unsharded (``sharded``: the run
    shards it) or the other way round: the state would silently restart from zeros."""
    states = [s for s in (saved.get("worker_states") or {}).values() if isinstance(s, dict)]
    has_shards = any(s.get("optimizer_shard") is not None for s in states)
    has_whole = any(s.get("optimizer") is not None for s in states)
    if gradient_averaging and has_shards != sharded and (has_shards or has_whole):
        held, run = ("sharded", "without") if has_shards else ("whole", "with")
        raise ConfigError(
            f"this checkpoint holds {held} optimizer state; resuming it {run} "
            "GradientAveraging(shard_optimizer=True) would restart the optimizer from zeros. Resume with the "
            "setting that wrote it, or train into a new checkpoint_dir"
        )
    written = saved.get("strategy")
    if gradient_averaging and written not in (None, "GradientAveraging"):
        raise ConfigError(
            f"this checkpoint was written by {written}; resuming it with GradientAveraging would start the "
            "workers from different optimizer states. Resume with the strategy that wrote it, or train into a "
            "new checkpoint_dir"
        )


def restore_history(history: History, saved: dict[str, Any]) -> None:
    """Put the saved History back (params stay those of the new run)."""
    history.history = {k: list(v) for k, v in saved["history"].items()}
    history.epoch_seconds = list(saved["epoch_seconds"])
    history.recorded_epochs = list(saved.get("epoch", range(len(history.epoch_seconds))))
    history.stats = [RoundStats(**s) for s in saved["stats"]]
    history.events = list(saved["events"])


def restore_rng(state: dict[str, Any]) -> None:
    """The master's numpy and Python random states as they were at the checkpoint."""
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
