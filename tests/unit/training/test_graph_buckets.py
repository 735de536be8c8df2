"""The reduction inside TensorFlow's step graph (``ddlf.training.replica.graph_buckets``), in one process: the ring
is a function standing in for it (no daemons). What the ranks would agree on is checked end to end in
``tests/e2e/test_gradients.py``."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("the in-graph exchange is for Keras on TensorFlow", allow_module_level=True)

from ddlf.errors import CollectiveError  # noqa: E402
from ddlf.training.replica.graph_buckets import GraphBuckets  # noqa: E402
from ddlf.training.replica.steppers import stepper_for  # noqa: E402


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    m = keras.Sequential(
        [keras.Input(shape=(6,)), keras.layers.Dense(5, activation="relu"), keras.layers.Dense(3, activation="softmax")]
    )
    m.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def _batch(rows: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((rows, 6)).astype(np.float32), rng.integers(0, 3, rows)


def _stepped(stepper, gradients) -> list[np.ndarray]:
    """The weights after one SGD step (the model's optimizer, learning rate 0.01) with ``gradients``."""
    return [np.asarray(v.numpy()) - 0.01 * g for v, g in zip(stepper.trainable, gradients)]


def _assert_weights(stepper, want: list[np.ndarray]) -> None:
    for v, w in zip(stepper.trainable, want):
        np.testing.assert_allclose(np.asarray(v.numpy()), w, rtol=1e-6, atol=1e-7)


def _exchange(buckets: GraphBuckets, stepper, batch, weight: float, reduce):
    if batch is None:
        return buckets.exchange(None, weight, reduce)
    x, y = batch
    return buckets.exchange(lambda: stepper.backward(x, y), weight, reduce)


def test_buckets_cut_in_reverse_order_and_the_mean_of_identical_ranks_is_the_gradient() -> None:
    stepper = stepper_for(_model())
    buckets = stepper.buckets(64)  # 64 bytes: the last layer (5x3 kernel, 3 biases) apart from the first
    assert isinstance(buckets, GraphBuckets)
    assert buckets.members[0][0] == len(stepper.trainable) - 1  # the last layer's weights go first
    assert sorted(i for m in buckets.members for i in m) == list(range(len(stepper.trainable)))
    assert buckets.members == [[3, 2], [1, 0]]
    x, y = _batch()
    want = _stepped(stepper, stepper.gradients(x, y))
    calls = []

    def mean_of_two_identical_ranks(flat: np.ndarray) -> None:
        calls.append(flat.size)
        flat[...] = (flat + flat) / 2

    averaged, totals, bad = _exchange(buckets, stepper, (x, y), 1.0, mean_of_two_identical_ranks)
    assert averaged is None  # the optimizer's step was taken in the same graph
    assert len(calls) == len(buckets.members) and not bad and totals == [1.0] * len(buckets.members)
    _assert_weights(stepper, want)


def test_a_partial_batch_is_weighted_and_divided_by_the_mean_weight() -> None:
    stepper = stepper_for(_model())
    buckets = stepper.buckets(1 << 20)
    x, y = _batch()
    want = _stepped(stepper, stepper.gradients(x, y))

    def with_a_rank_without_rows(flat: np.ndarray) -> None:
        flat[...] = (flat + 0) / 2  # the other rank sends zeros with weight 0

    _, totals, _ = _exchange(buckets, stepper, (x, y), 0.5, with_a_rank_without_rows)
    assert totals == [0.25]
    _assert_weights(stepper, want)
    # No batch on any rank: zeros with weight 0 go to the ring, and no step is taken.
    sent = []
    _, totals, bad = _exchange(buckets, stepper, None, 0.0, lambda flat: sent.append(flat.copy()))
    assert totals == [0.0] and not bad and not sent[0].any()
    _assert_weights(stepper, want)


def test_non_finite_gradients_are_sent_as_zeros_with_weight_zero_and_reported() -> None:
    stepper = stepper_for(_model())
    buckets = stepper.buckets(1 << 20)
    x, y = _batch()
    x[0, 0] = np.nan
    before = [np.asarray(v.numpy()) for v in stepper.trainable]
    sent = []
    _, totals, bad = _exchange(buckets, stepper, (x, y), 1.0, lambda flat: sent.append(flat.copy()))
    assert bad and totals == [0.0] and not sent[0].any()
    _assert_weights(stepper, before)  # nothing reached the weights


def test_a_ring_failure_inside_the_graph_is_raised_as_itself() -> None:
    stepper = stepper_for(_model())
    buckets = stepper.buckets(64)

    def fails(flat: np.ndarray) -> None:
        raise CollectiveError("the right neighbour closed the link", peer_rank=1)

    with pytest.raises(CollectiveError, match="closed the link") as caught:
        _exchange(buckets, stepper, _batch(), 1.0, fails)
    assert caught.value.peer_rank == 1
    # The stepper still works afterwards (a redo of the round runs the same graph).
    _, totals, _ = _exchange(buckets, stepper, _batch(), 1.0, lambda flat: None)
    assert totals == [1.0, 1.0] and all(np.isfinite(v.numpy()).all() for v in stepper.trainable)


def test_models_it_cannot_run_get_the_one_buffer_exchange() -> None:
    model = _model()
    stepper = stepper_for(model)
    assert stepper.buckets(1 << 20, "float16") is None  # half precision: the overflow check reads arrays
    model.jit_compile = True
    assert stepper_for(model).buckets(1 << 20) is None  # XLA cannot call back into Python


def test_where_tensorflow_hands_python_a_copy_the_result_comes_back_through_the_copy(monkeypatch) -> None:
    from ddlf.training.replica import graph_buckets

    monkeypatch.setattr(graph_buckets, "_WRITES_THROUGH", False)
    stepper = stepper_for(_model())
    buckets = GraphBuckets(stepper, 64)
    x, y = _batch()
    want = _stepped(stepper, stepper.gradients(x, y))

    def doubled_then_halved(flat: np.ndarray) -> None:
        flat[...] = (flat + flat) / 2

    _, totals, bad = _exchange(buckets, stepper, (x, y), 1.0, doubled_then_halved)
    assert not bad and totals == [1.0, 1.0] and not buckets._stash  # every copy taken back
    _assert_weights(stepper, want)


def test_a_short_batch_runs_the_graph_traced_for_the_full_ones() -> None:
    """The step is traced once for any batch size (as fit's): the epoch's last, short batch is not a second
    trace in the first epoch."""
    stepper = stepper_for(_model())
    buckets = stepper.buckets(1 << 20)
    assert isinstance(buckets, GraphBuckets)
    _exchange(buckets, stepper, _batch(8), 1.0, lambda flat: None)
    x, y = _batch(3)
    want = _stepped(stepper, stepper.gradients(x, y))
    _, totals, _ = _exchange(buckets, stepper, (x, y), 3 / 8, lambda flat: None)  # one rank: the mean is itself
    assert totals == [pytest.approx(3 / 8)]
    _assert_weights(stepper, want)
    assert buckets._with.experimental_get_tracing_count() == 1


def test_a_step_without_a_batch_sends_zeros_every_time_whatever_the_ring_wrote_last() -> None:
    """A rank without rows sends zeros with weight 0 at every such step. Its graph's buffers come from constants
    (zeros and the weight's element), which TensorFlow may fold into one buffer that it reuses: the ring's result
    written into it last time must not reach the next step's send."""
    stepper = stepper_for(_model())
    buckets = stepper.buckets(64)
    sent = []

    def mean_written_back(parts: np.ndarray | list[np.ndarray]) -> None:
        for p in parts if isinstance(parts, list) else [parts]:
            sent.append(p.copy())
            p[...] = 0.5  # what the ring leaves there: the other rank's rows averaged in

    for _ in range(3):
        _exchange(buckets, stepper, None, 0.0, mean_written_back)
    assert sent and not any(s.any() for s in sent)
