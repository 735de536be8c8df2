"""The strategy ``app.train`` picks when given none (``ddlf.training.defaults``), without daemons."""

from __future__ import annotations

from typing import Any

import pytest

from ddlf.training.defaults import default_strategy
from ddlf.training.options import GradientAveraging, ModelAveraging


def _model(optimizer: Any = "adam", own_step: bool = False) -> Any:
    import keras

    base = keras.Sequential
    if own_step:

        class OwnStep(keras.Sequential):
            def train_step(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never run here
                return super().train_step(*args, **kwargs)

        base = OwnStep
    model = base([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def test_two_or_more_workers_average_gradients_with_the_learning_rate_scaled() -> None:
    for workers in (2, 5):
        strategy, reason = default_strategy(_model(), workers)
        assert strategy == GradientAveraging(scale_learning_rate=True)
        assert f"x {workers}" in reason


def test_one_worker_trains_as_fit_does() -> None:
    strategy, reason = default_strategy(_model(), 1)
    assert strategy == ModelAveraging()
    assert "one worker" in reason


def test_a_learning_rate_schedule_is_left_as_the_user_wrote_it() -> None:
    import keras

    schedule = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=100)
    strategy, reason = default_strategy(_model(keras.optimizers.Adam(schedule)), 2)
    assert strategy == GradientAveraging(scale_learning_rate=False)
    assert "schedule is not scaled" in reason


def test_a_model_with_its_own_train_step_is_averaged_by_weights() -> None:
    strategy, reason = default_strategy(_model(own_step=True), 3)
    assert strategy == ModelAveraging()
    assert "OwnStep has its own train_step" in reason


@pytest.mark.parametrize(
    ("written", "shard", "expected"),
    [
        ("ModelAveraging", False, ModelAveraging()),
        ("Asynchronous", False, ModelAveraging()),
        (None, False, ModelAveraging()),  # a checkpoint from before strategies were recorded: the old default
        ("GradientAveraging", False, GradientAveraging(scale_learning_rate=True)),
        ("GradientAveraging", True, GradientAveraging(scale_learning_rate=True, shard_optimizer=True)),
    ],
)
def test_a_resumed_checkpoint_keeps_the_strategy_that_wrote_it(written: Any, shard: bool, expected: Any) -> None:
    state = {"optimizer_shard": [1.0]} if shard else {"optimizer": [1.0]}
    saved = {"strategy": written, "worker_states": {0: state, 1: state}}
    strategy, reason = default_strategy(_model(), 2, saved)
    assert strategy == expected
    assert reason.startswith("resuming a checkpoint written by")
    # on one worker too: the checkpoint decides, not the worker count
    assert default_strategy(_model(), 1, saved)[0] == expected


@pytest.mark.parametrize(("scaled", "expected"), [(True, True), (False, False), (None, True)])
def test_a_resumed_gradient_averaging_checkpoint_keeps_its_learning_rate_scaling(scaled: Any, expected: bool) -> None:
    """A run that chose GradientAveraging() unscaled, resumed with no strategy given, goes on unscaled (its
    optimizer's moments were made at that rate); a checkpoint from before the choice was recorded (None) gets
    the default's scaling."""
    saved = {"strategy": "GradientAveraging", "scale_learning_rate": scaled, "worker_states": {}}
    strategy, _ = default_strategy(_model(), 2, saved)
    assert strategy == GradientAveraging(scale_learning_rate=expected)


def test_a_wrong_run_option_is_refused_before_the_default_is_chosen() -> None:
    import ddlf

    class App(ddlf.IApp):
        def load_dataset(self) -> Any:  # pragma: no cover - never reached
            raise AssertionError("the run option is checked first")

        def create_model(self) -> Any:  # pragma: no cover - never reached
            raise AssertionError("the run option is checked first")

    with pytest.raises(TypeError, match=r"run must be a ddlf\.RunConfig"):
        App(None).train(1, 32, run="ckpt")  # type: ignore[arg-type]
