"""ASHA's stop decisions, without daemons."""

from __future__ import annotations

from ddlf.tune.asha import _Asha
from ddlf.tune.result import SweepResult, Trial


def test_rungs_grow_by_the_reduction_factor() -> None:
    assert _Asha(epochs=27, grace=1, rf=3, mode="max").rungs == [1, 3, 9]
    assert _Asha(epochs=10, grace=2, rf=2, mode="max").rungs == [2, 4, 8]
    assert _Asha(epochs=1, grace=1, rf=3, mode="max").rungs == []


def test_only_the_best_third_continues_at_a_rung() -> None:
    asha = _Asha(epochs=9, grace=1, rf=3, mode="max")
    # The first trial to reach a rung always continues (it is the best so far).
    assert asha.keep_going(1, 0.5)
    assert not asha.keep_going(1, 0.4)  # 2 seen: the best 1 continues
    assert asha.keep_going(1, 0.9)  # a new best
    assert not asha.keep_going(1, 0.6)  # 4 seen, best 1: 0.9
    assert asha.keep_going(2, 0.1)  # not a rung: no decision
    assert not asha.keep_going(1, float("nan"))  # a metric that is not a number stops the trial


def test_the_cut_is_ray_tunes_percentile_of_earlier_trials() -> None:
    # Ray Tune's ASHAScheduler: stop when below the (1 - 1/rf) percentile (linear interpolation) of the metrics
    # that reached the rung before this trial. rf 2: the median of what came before.
    asha = _Asha(epochs=8, grace=1, rf=2, mode="max")
    assert asha.keep_going(1, 0.5)
    assert asha.keep_going(1, 0.6)  # the median of [0.5] is 0.5
    assert asha.keep_going(1, 0.55)  # the median of [0.5, 0.6] is 0.55: not below it (a best-half rank would stop)
    assert not asha.keep_going(1, 0.54)  # the median of [0.5, 0.6, 0.55] is 0.55
    # rf 3: the 66.7th percentile of [0.4, 0.5, 0.9] is 0.5 + (0.9 - 0.5) / 3 = 0.633
    three = _Asha(epochs=9, grace=1, rf=3, mode="max")
    for v in (0.5, 0.4, 0.9):
        three.keep_going(1, v)
    assert not three.keep_going(1, 0.63) and three.keep_going(1, 0.64)
    assert three.keep_going(3, 0.1)  # the first to reach rung 3 continues


def test_lower_is_better_in_min_mode() -> None:
    asha = _Asha(epochs=9, grace=1, rf=2, mode="min")
    assert asha.keep_going(1, 2.0)
    assert asha.keep_going(1, 1.0)
    assert not asha.keep_going(1, 3.0)


def test_the_best_trial_and_the_table() -> None:
    trials = [Trial(0, {"lr": 1}, "completed", metric=0.7), Trial(1, {"lr": 2}, "stopped", metric=0.9), Trial(2, {})]
    result = SweepResult(trials, "val_accuracy", "max", 1.0)
    assert result.best.index == 1
    assert result.table()[1] == {
        "lr": 2,
        "status": "stopped",
        "epochs": 0,
        "val_accuracy": 0.9,
        "seconds": 0.0,
        "workers": [],
    }


def test_each_trial_gets_its_own_callbacks_without_what_an_earlier_run_left_on_them() -> None:
    import sys

    from ddlf.callbacks import Callback, EarlyStopping
    from ddlf.tune.sweep import _own_copies

    class Heavy:
        copies = 0

        def __deepcopy__(self, memo: dict) -> Heavy:
            Heavy.copies += 1
            return Heavy()

    stop = EarlyStopping(patience=2)
    stop.app, stop.model, stop.history = Heavy(), Heavy(), Heavy()  # as an earlier train() leaves them
    shared = Callback()
    shared.stream = sys.stdout  # type: ignore[attr-defined]
    a, b = _own_copies([stop, shared]), _own_copies([stop, shared])
    assert a[0] is not b[0] and a[0] is not stop and a[0].patience == 2
    assert (a[0].app, a[0].model, a[0].history) == (None, None, None) and Heavy.copies == 0
    assert a[1].stream is sys.stdout
    assert (stop.app, stop.model) != (None, None)  # the originals keep theirs


def test_validation_freq_as_fit_reads_it() -> None:
    from ddlf.training.options import validates

    assert [e for e in range(9) if validates(3, e)] == [2, 5, 8]  # epochs counted from 0: after the 3rd, 6th, 9th
    assert [e for e in range(6) if validates({1, 4}, e)] == [0, 3]
