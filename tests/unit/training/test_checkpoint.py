"""Checkpoints (``ddlf.training.checkpoint``) without daemons: a round trip, atomic writes, clear refusals."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np
import pytest

from ddlf.training import checkpoint
from ddlf.training.history import History, RoundStats


def _history() -> History:
    h = History()
    h.history = {"loss": [0.9, 0.5], "accuracy": [0.6, 0.8]}
    h.epoch_seconds = [1.5, 1.2]
    h.stats = [RoundStats(0, 0, 1, 64, 0.2, 0.01, 0.0, 100, 200, start=0.1, send_seconds=0.02)]
    h.events = [{"event": "lost", "worker": 1}]
    return h


def _save(directory: Path, epochs_done: int = 2, **strategy: object) -> Path:
    return checkpoint.save(
        directory,
        epochs_done=epochs_done,
        mode="sync",
        seed=7,
        weights=[np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.float32)],
        optimizer_state=[np.zeros(2, np.float32)],
        worker_states={0: {"rng": [np.array([1, 2])]}, 1: None},
        history=_history(),
        outer_state=None,
        **strategy,  # type: ignore[arg-type]
    )


def test_a_checkpoint_round_trips_weights_states_history_and_random_state(tmp_path: Path) -> None:
    np.random.seed(3)
    random.seed(3)
    path = _save(tmp_path / "ckpt", strategy="GradientAveraging", scale_learning_rate=False)
    assert path == checkpoint.path_in(tmp_path / "ckpt") and path.exists()
    expected = (np.random.random(), random.random())  # what the generators give right after the save
    np.random.seed(99)
    random.seed(99)
    state = checkpoint.load(tmp_path / "ckpt")
    assert state is not None and state["epochs_done"] == 2 and state["mode"] == "sync" and state["seed"] == 7
    assert state["strategy"] == "GradientAveraging" and state["scale_learning_rate"] is False
    np.testing.assert_array_equal(state["weights"][0], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert set(state["worker_states"]) == {0, 1}
    checkpoint.restore_rng(state)
    assert (np.random.random(), random.random()) == expected
    h = History()
    checkpoint.restore_history(h, state["history"])
    assert h.history == _history().history and h.epoch_seconds == [1.5, 1.2]
    assert h.stats == _history().stats and h.events == [{"event": "lost", "worker": 1}]


def test_no_checkpoint_yet_is_none_and_a_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    assert checkpoint.load(tmp_path) is None
    _save(tmp_path, 1)
    _save(tmp_path, 2)  # replaced whole
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.FILENAME]
    state = checkpoint.load(tmp_path)
    assert state is not None and state["epochs_done"] == 2


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"not a pickle at all", "not a readable ddlf checkpoint"),
        (pickle.dumps([1, 2, 3]), "not a ddlf checkpoint of format"),
        (pickle.dumps({"format": 999}), "found 999"),
        (b"", "not a readable ddlf checkpoint"),
    ],
)
def test_a_file_that_is_not_a_checkpoint_is_refused_by_name(tmp_path: Path, content: bytes, match: str) -> None:
    checkpoint.path_in(tmp_path).write_bytes(content)
    with pytest.raises(ValueError, match=match) as info:
        checkpoint.load(tmp_path)
    assert str(checkpoint.path_in(tmp_path)) in str(info.value)


def test_an_unwritable_directory_is_a_checkpoint_error_that_keeps_the_previous(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    with pytest.raises(checkpoint.CheckpointError) as info:
        _save(blocker / "ckpt", 2)
    assert isinstance(info.value, OSError) and "epoch 2" in str(info.value) and "resume=True" in str(info.value)
    state = checkpoint.load(tmp_path)
    assert state is not None and state["epochs_done"] == 1


@pytest.mark.parametrize("written", ["ModelAveraging", "Asynchronous"])
def test_gradient_averaging_refuses_a_checkpoint_another_strategy_wrote(tmp_path: Path, written: str) -> None:
    # Its workers' optimizer states differ; gradient averaging would start its replicas apart and never notice.
    checkpoint.save(
        tmp_path,
        epochs_done=1,
        mode="sync" if written == "ModelAveraging" else "async",
        seed=0,
        weights=[np.zeros(2, np.float32)],
        optimizer_state=None,
        worker_states={},
        history=History(),
        strategy=written,
    )
    state = checkpoint.load(tmp_path)
    assert state is not None and state["strategy"] == written
    with pytest.raises(ValueError, match=f"written by {written}; resuming it with GradientAveraging"):
        checkpoint.check_resumable(state, gradient_averaging=True)
    checkpoint.check_resumable(state, gradient_averaging=False)  # any other strategy resumes it


def test_a_checkpoint_of_gradient_averaging_or_of_an_unnamed_strategy_resumes_under_it(tmp_path: Path) -> None:
    _save(tmp_path)  # written without a strategy name, as before it was recorded
    state = checkpoint.load(tmp_path)
    assert state is not None and state["strategy"] is None
    checkpoint.check_resumable(state, gradient_averaging=True)
    checkpoint.check_resumable({**state, "strategy": "GradientAveraging"}, gradient_averaging=True)
