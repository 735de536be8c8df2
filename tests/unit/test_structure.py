"""A dataset's parts as ``fit`` takes them (``ddlf.data.structure``), ``train``'s data arguments (``FitData``,
``validation_freq``) and the row plans they change: pure logic, no daemons."""

from __future__ import annotations

import numpy as np
import pytest

import ddlf
from ddlf.data.structure import Parts, class_weights, concatenate_rows, rows_of
from ddlf.training.messages import FitData
from ddlf.training.options import TrainConfig
from ddlf.training.plan import epoch_order
from ddlf.training.remote_evaluation import contiguous_parts, merge_evaluations
from ddlf.training.replica.dataset import parts_of, training_rows


def test_plain_arrays_stay_two_leaves_and_pack_as_they_are() -> None:
    x, y = np.zeros((5, 3), np.float32), np.arange(5)
    parts = Parts.loaded((x, y))
    assert parts.simple and parts.rows == 5 and len(parts.leaves) == 2
    assert parts.leaves[0] is x and parts.leaves[1] is y  # no copy
    bx, by, sw = parts.pack((x[:2], y[:2]))
    assert bx.shape == (2, 3) and list(by) == [0, 1] and sw is None


def test_named_inputs_and_outputs_round_trip_through_the_leaves() -> None:
    x = {"image": np.arange(12).reshape(4, 3), "meta": (np.arange(4), np.ones((4, 2)))}
    y = [np.arange(4) * 10, {"aux": np.arange(4) * 100}]
    parts = Parts.loaded({"x": x, "y": y, "sample_weight": np.full(4, 0.5)})
    assert not parts.simple and parts.rows == 4 and len(parts.leaves) == 6
    assert parts.names() == [
        "x['image']",
        "x['meta'][0]",
        "x['meta'][1]",
        "y[0]",
        "y[1]['aux']",
        "sample_weight",
    ]
    bx, by, sw = parts.pack([leaf[1:3] for leaf in parts.leaves])
    assert list(bx) == ["image", "meta"] and isinstance(bx["meta"], tuple)
    assert bx["image"].tolist() == [[3, 4, 5], [6, 7, 8]]
    assert isinstance(by, list) and by[0].tolist() == [10, 20] and by[1]["aux"].tolist() == [100, 200]
    assert sw.tolist() == [0.5, 0.5]
    assert rows_of(bx) == 2


def test_pandas_frames_and_series_become_their_values() -> None:
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0]})
    parts = Parts.loaded((df, pd.Series([0, 1, 0])))
    assert isinstance(parts.leaves[0], np.ndarray) and parts.leaves[0].shape == (3, 2)
    assert parts.leaves[1].tolist() == [0, 1, 0]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ((np.array(["a", None], dtype=object), np.arange(2)), r"x holds Python objects \(dtype object\)"),
        (({"a": np.zeros(3), "b": np.zeros(4)}, np.arange(3)), r"x\['a'\]: 3, x\['b'\]: 4, y: 3"),
        (({1: np.zeros(3)}, np.arange(3)), "name the model's inputs or outputs with strings"),
        ((np.float32(1.0), np.arange(1)), "0-d array"),
        ({"inputs": np.zeros(3), "y": np.zeros(3)}, "takes 'x', 'y' and optionally 'sample_weight'"),
        ((np.zeros(3),), r"must return \(x, y\)"),
        (({}, np.zeros(3)), "empty dict"),
    ],
)
def test_a_dataset_that_cannot_be_batched_is_refused_naming_its_part(value: object, message: str) -> None:
    with pytest.raises(ddlf.DatasetError, match=message):
        Parts.loaded(value)


def test_train_sample_weights_join_the_parts_once() -> None:
    parts = parts_of((np.zeros((4, 2)), np.arange(4)), FitData(sample_weight=np.arange(4.0)))
    assert parts.pack([leaf[:2] for leaf in parts.leaves])[2].tolist() == [0.0, 1.0]
    with pytest.raises(ddlf.DatasetError, match="3 entries for a dataset of 4 rows"):
        parts_of((np.zeros((4, 2)), np.arange(4)), FitData(sample_weight=np.ones(3)))
    with pytest.raises(ddlf.DatasetError, match="keep one of them"):
        parts_of((np.zeros((4, 2)), np.arange(4), np.ones(4)), FitData(sample_weight=np.ones(4)))
    with pytest.raises(ddlf.DatasetError, match="single array of labels"):
        parts_of((np.zeros((4, 2)), {"a": np.arange(4)}), FitData(class_weight={0: 2.0}))


def test_class_weights_follow_fit_for_integer_column_and_one_hot_labels() -> None:
    cw = {0: 1.0, 1: 3.0}
    assert class_weights(np.array([0, 1, 1, 2]), cw).tolist() == [1.0, 3.0, 3.0, 1.0]  # 2: not listed, weighs 1
    assert class_weights(np.array([[1], [0]]), cw).tolist() == [3.0, 1.0]
    assert class_weights(np.eye(3)[[1, 0, 2]], cw).tolist() == [3.0, 1.0, 1.0]
    assert class_weights(np.array([0.9, 0.2]), cw).tolist() == [3.0, 1.0]  # rounded, as fit rounds


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"validation_split": 1.0}, "validation_split must be a number >= 0 and < 1"),
        ({"validation_split": "0.2"}, "validation_split"),
        ({"shuffle": "batch"}, "shuffle must be True or False"),
        ({"class_weight": [1.0, 2.0]}, "class_weight must be a dict"),
        ({"class_weight": {"cat": 1.0}}, "class indices"),
        ({"class_weight": {0: float("nan")}}, "finite number"),
        ({"class_weight": {0: 1.0}, "sample_weight": np.ones(3)}, "cannot be given together"),
        ({"sample_weight": ["a", "b"]}, "array of numbers"),
        ({"sample_weight": np.array([1.0, np.inf])}, "NaN or infinite"),
    ],
)
def test_fit_arguments_check_themselves(kwargs: dict, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        FitData(**kwargs)


def test_validation_split_holds_out_the_last_rows_as_fit_does() -> None:
    assert training_rows(100, FitData(validation_split=0.25)) == 75
    assert training_rows(10, FitData(validation_split=0.15)) == 8  # floor(10 * 0.85), fit's rule
    assert training_rows(10, FitData()) == 10
    with pytest.raises(ddlf.DatasetError, match="leaves no of the 1 rows"):
        training_rows(1, FitData(validation_split=0.5))


def test_validation_freq_as_fit_reads_it() -> None:
    every2 = TrainConfig(epochs=4, batch_size=8, validation_freq=2)
    assert [e for e in range(4) if every2.validates(e)] == [1, 3]
    listed = TrainConfig(epochs=4, batch_size=8, validation_freq=[1, 4])
    assert [e for e in range(4) if listed.validates(e)] == [0, 3]
    for bad in (0, [0, 2], "2", 1.5):
        with pytest.raises(ValueError, match="validation_freq"):
            TrainConfig(epochs=4, batch_size=8, validation_freq=bad)


def test_shuffle_false_visits_rows_in_order() -> None:
    assert epoch_order(5, 0, 3, shuffle=False).tolist() == [0, 1, 2, 3, 4]
    shuffled = epoch_order(50, 0, 0)
    assert sorted(shuffled.tolist()) == list(range(50)) and shuffled.tolist() != list(range(50))


def test_contiguous_parts_cover_the_rows_in_order() -> None:
    assert contiguous_parts(10, 17, 3) == [(10, 13), (13, 15), (15, 17)]
    assert contiguous_parts(0, 1, 3) == [(0, 1), (1, 1), (1, 1)]
    # whole batches of 16 (the last may be short), as one process batches the rows
    assert contiguous_parts(144, 192, 2, 16) == [(144, 176), (176, 192)]
    assert contiguous_parts(0, 40, 3, 16) == [(0, 16), (16, 32), (32, 40)]


def test_concatenate_rows_keeps_a_multi_output_structure() -> None:
    out = concatenate_rows([{"a": np.zeros((2, 1)), "b": [np.ones(2)]}, {"a": np.zeros((1, 1)), "b": [np.ones(1)]}])
    assert out["a"].shape == (3, 1) and isinstance(out["b"], list) and out["b"][0].shape == (3,)


def test_a_round_with_neither_indices_nor_a_slice_feeds_no_batches() -> None:
    from ddlf.training.messages import Rows
    from ddlf.training.replica.session import Session

    x, y = np.arange(12, dtype=np.float32).reshape(6, 2), np.arange(6)
    session = Session(run_id="r", app=ddlf.IApp.__new__(ddlf.IApp), model=None, parts=Parts.loaded((x, y)), rows=6)
    assert Rows().count() == 0 and list(session.feed(Rows(), 4, 2)) == []
    batches = list(session.feed(Rows(indices=np.array([5, 0, 3], dtype=np.uint32)), 2, 2))
    assert [n for *_, n in batches] == [2, 1]
    np.testing.assert_array_equal(batches[0][0], x[[5, 0]])
    np.testing.assert_array_equal(batches[1][1], y[[3]])


def test_a_torch_models_merged_logs_keep_its_order_and_weigh_by_rows() -> None:
    """``app.evaluate()`` without arrays lists a TorchModel's results in its own order (loss first, as
    ``evaluate(x, y)`` does), not sorted by name: ``loss, acc = app.evaluate()`` unpacked them swapped."""
    outs = [
        {"rows": 30, "logs": {"loss": 0.5, "accuracy": 0.9, "b_loss": 1.0}},
        {"rows": 10, "logs": {"loss": 0.1, "accuracy": 0.5, "b_loss": 3.0}},
        {"rows": 0},
    ]
    merged = merge_evaluations(None, "run", [0, 1, 2], outs)
    assert list(merged) == ["loss", "accuracy", "b_loss"]
    assert merged == pytest.approx({"loss": 0.4, "accuracy": 0.8, "b_loss": 1.5})
