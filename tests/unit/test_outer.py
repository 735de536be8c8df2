"""The outer optimizer's step (``ddlf.training.outer``): Nesterov momentum on the round's change, checked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from ddlf.training.outer import OuterMomentum, OuterSpec


def test_nesterov_step_by_hand() -> None:
    outer = OuterMomentum(OuterSpec("nesterov", 0.5, 0.9))
    start = [np.array([1.0, 2.0], np.float32), np.array([3], np.int64)]
    avg = [np.array([0.0, 1.0], np.float32), np.array([4], np.int64)]
    new = outer.step(start, avg, [True, True])
    g = np.array([1.0, 1.0], np.float32)  # start - average
    m = g  # momentum from zero
    np.testing.assert_allclose(new[0], start[0] - 0.5 * (g + 0.9 * m))
    assert new[1].tolist() == [4]  # integers take the average
    assert new[0].dtype == np.float32
    # Second round: the momentum carries the first round's change.
    new2 = outer.step(new, [new[0] - 1, new[1]], [True, True])
    m2 = 0.9 * m + 1.0
    np.testing.assert_allclose(new2[0], new[0] - 0.5 * (1.0 + 0.9 * m2), rtol=1e-6)


def test_learning_rate_one_without_momentum_is_plain_averaging() -> None:
    rng = np.random.default_rng(0)
    start = [rng.standard_normal((4, 3)).astype(np.float32)]
    avg = [rng.standard_normal((4, 3)).astype(np.float32)]
    new = OuterMomentum(OuterSpec("nesterov", 1.0, 0.0)).step(start, avg, [True])
    np.testing.assert_allclose(new[0], avg[0], atol=1e-6)


def test_untrained_weights_take_the_average_and_state_round_trips() -> None:
    outer = OuterMomentum(OuterSpec())
    start = [np.ones(3, np.float32), np.zeros(2, np.float32)]
    avg = [np.zeros(3, np.float32), np.ones(2, np.float32)]
    new = outer.step(start, avg, [True, False])
    np.testing.assert_array_equal(new[1], avg[1])  # a BatchNorm statistic: the average as it is
    saved = outer.state()
    assert saved is not None and saved[1].size == 0
    other = OuterMomentum(OuterSpec())
    other.load(saved)
    a, b = outer.step(new, avg, [True, False]), other.step(new, avg, [True, False])
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))  # the same momentum, the same bits


@pytest.mark.parametrize(
    "spec",
    [
        OuterSpec("adam"),
        OuterSpec(learning_rate=0),
        OuterSpec(learning_rate=float("nan")),
        OuterSpec(momentum=1.0),
        OuterSpec(momentum=-0.1),
        OuterSpec(learning_rate=True),
    ],
)
def test_bad_specs_are_refused(spec: OuterSpec) -> None:
    with pytest.raises(ValueError):
        spec.check()


def test_mismatched_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="outer step"):
        OuterMomentum(OuterSpec()).step([np.ones(2)], [], [True])
