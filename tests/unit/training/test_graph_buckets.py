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
from ddlf.training.replica.graph_buckets import ALIGN, GraphBuckets, aligned  # noqa: E402
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


def _ring(mean):
    """A stand-in for the ring's out-of-place reduction: ``mean(flat)`` of this rank's parts (concatenated) is
    what the ranks' mean would be, written into ``out``."""

    def reduce(parts: list[np.ndarray], out: list[np.ndarray]) -> None:
        flat = mean(np.concatenate([np.ravel(p) for p in parts]))
        at = 0
        for o in out:
            o.reshape(-1)[...] = flat[at : at + o.size]
            at += o.size
        assert at == flat.size

    return reduce


class _Shared:
    """A stand-in for a host's shared memory (``exchange``'s ``share``): one rank's mean is its parts'
    concatenation, left in a cache-line aligned buffer per tag that the next call with the tag rewrites."""

    def __init__(self) -> None:
        self.regions: dict[int, np.ndarray] = {}
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, parts: list[np.ndarray], tag: int) -> np.ndarray:
        self.calls.append((tag, [p.size for p in parts]))
        flat = np.concatenate([np.ravel(p) for p in parts])
        region = self.regions.get(tag)
        if region is None or region.size != flat.size:
            region = self.regions[tag] = aligned(flat.shape)
        region[...] = flat
        shared = region.view()
        shared.flags.writeable = False  # as the ring's: the host's members share it
        return shared


class _FakeRing:
    """What :class:`GraphBuckets` calls (``ddlf.worker.reduction.BucketRing`` on a worker): ``into`` the
    out-of-place reduction, ``shared`` the result left in shared memory where given."""

    def __init__(self, into, shared=None) -> None:
        self.into, self.shared, self.shares = into, shared, shared is not None


def _exchange(buckets: GraphBuckets, stepper, batch, weight: float, reduce, share=None):
    ring = _FakeRing(reduce, share)
    if batch is None:
        return buckets.exchange(None, weight, ring)
    x, y = batch
    return buckets.exchange(lambda: stepper.backward(x, y), weight, ring)


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

    def mean_of_two_identical_ranks(flat: np.ndarray) -> np.ndarray:
        calls.append(flat.size)
        return (flat + flat) / 2

    averaged, totals, bad = _exchange(buckets, stepper, (x, y), 1.0, _ring(mean_of_two_identical_ranks))
    assert averaged is None  # the optimizer's step was taken in the same graph
    assert len(calls) == len(buckets.members) and not bad and totals == [1.0] * len(buckets.members)
    _assert_weights(stepper, want)


def test_a_partial_batch_is_weighted_and_divided_by_the_mean_weight() -> None:
    stepper = stepper_for(_model())
    buckets = stepper.buckets(1 << 20)
    x, y = _batch()
    want = _stepped(stepper, stepper.gradients(x, y))

    def with_a_rank_without_rows(flat: np.ndarray) -> np.ndarray:
        return (flat + 0) / 2  # the other rank sends zeros with weight 0

    _, totals, _ = _exchange(buckets, stepper, (x, y), 0.5, _ring(with_a_rank_without_rows))
    assert totals == [0.25]
    _assert_weights(stepper, want)
    # No batch on any rank: zeros with weight 0 go to the ring, and no step is taken.
    sent = []
    _, totals, bad = _exchange(buckets, stepper, None, 0.0, _ring(lambda flat: sent.append(flat.copy()) or flat))
    assert totals == [0.0] and not bad and not sent[0].any()
    _assert_weights(stepper, want)


def test_non_finite_gradients_are_sent_as_zeros_with_weight_zero_and_reported() -> None:
    stepper = stepper_for(_model())
    buckets = stepper.buckets(1 << 20)
    x, y = _batch()
    x[0, 0] = np.nan
    before = [np.asarray(v.numpy()) for v in stepper.trainable]
    sent = []
    _, totals, bad = _exchange(buckets, stepper, (x, y), 1.0, _ring(lambda flat: sent.append(flat.copy()) or flat))
    assert bad and totals == [0.0] and not sent[0].any()
    _assert_weights(stepper, before)  # nothing reached the weights


def test_a_ring_failure_inside_the_graph_is_raised_as_itself() -> None:
    stepper = stepper_for(_model())
    buckets = stepper.buckets(64)

    def fails(parts: list[np.ndarray], out: list[np.ndarray]) -> None:
        raise CollectiveError("the right neighbour closed the link", peer_rank=1)

    with pytest.raises(CollectiveError, match="closed the link") as caught:
        _exchange(buckets, stepper, _batch(), 1.0, fails)
    assert caught.value.peer_rank == 1
    # The stepper still works afterwards (a redo of the round runs the same graph).
    _, totals, _ = _exchange(buckets, stepper, _batch(), 1.0, _ring(lambda flat: flat))
    assert totals == [1.0, 1.0] and all(np.isfinite(v.numpy()).all() for v in stepper.trainable)


def test_models_it_cannot_run_get_the_one_buffer_exchange() -> None:
    model = _model()
    stepper = stepper_for(model)
    assert stepper.buckets(1 << 20, "float16") is None  # half precision: the overflow check reads arrays
    model.jit_compile = True
    assert stepper_for(model).buckets(1 << 20) is None  # XLA cannot call back into Python


def test_the_output_arrays_are_aligned_for_tensorflow_to_take_them_without_a_copy() -> None:
    for shape in [(1,), (3, 5), (2048, 10), (0,)]:
        a = aligned(shape)
        assert a.shape == shape and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % ALIGN == 0 or a.size == 0  # an empty array's address means nothing


class _KeepsTheLastGradient(keras.optimizers.SGD):
    """Not one of Keras's own: its state takes a gradient as it is (``assign``), which would make that variable
    share a kept output array."""

    def build(self, variables):
        super().build(variables)
        self.last = [self.add_variable_from_reference(v, "last") for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        self.assign(self.last[self._get_variable_index(variable)], gradient)
        super().update_step(gradient, variable, learning_rate)


OPTIMIZERS = {
    "sgd-momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "adafactor": lambda: keras.optimizers.Adafactor(0.01),
    "adam": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "ftrl": lambda: keras.optimizers.Ftrl(0.05),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "muon": lambda: keras.optimizers.Muon(0.01),
    "schedule-free-adamw": lambda: keras.optimizers.ScheduleFreeAdamW(0.01),
    "adam-ema-clipnorm": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=2, clipnorm=0.5),
    "sgd-accumulating": lambda: keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=2),
    "keeps-the-last-gradient": lambda: _KeepsTheLastGradient(0.05),
}


@pytest.mark.parametrize("where", ["arrays", "shared memory"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_steps_are_keras_own_and_the_optimizer_state_never_lives_where_results_land(optimizer: str, where: str) -> None:
    """For Keras's own optimizers the ring writes each step's means into the same output arrays, which
    TensorFlow takes as its tensors without a copy: nothing the optimizer keeps (its variables, the weights) may
    live there. After every step the arrays are overwritten with NaN (as the next step's reduction would
    overwrite them); the weights and the optimizer's state still match Keras's own ``train_step`` step for step,
    with an optimizer of another kind (whose state takes a gradient as it is) too."""
    ours, theirs = _model(), _model()
    for m in (ours, theirs):
        m.compile(optimizer=OPTIMIZERS[optimizer](), loss="sparse_categorical_crossentropy")
    stepper, reference = stepper_for(ours), stepper_for(theirs)
    buckets = stepper.buckets(64)
    assert isinstance(buckets, GraphBuckets)
    assert buckets._keeps == (optimizer != "keeps-the-last-gradient")
    rng = np.random.default_rng(3)
    share = _Shared() if where == "shared memory" else None
    for _ in range(5):
        x, y = rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)
        _exchange(buckets, stepper, (x, y), 1.0, _ring(lambda flat: flat), share)
        for out in buckets._out:
            for a in out or []:
                a[...] = np.nan
        for region in (share.regions if share else {}).values():
            region[...] = np.nan  # what the other ranks' next sums would leave there
        reference.step(x, y)
        reference.end()
        for a, b in zip(ours.weights + ours.optimizer.variables, theirs.weights + theirs.optimizer.variables):
            np.testing.assert_allclose(np.asarray(a.numpy()), np.asarray(b.numpy()), rtol=1e-6, atol=1e-7)
    if share is not None:
        assert bool(share.calls) == buckets._keeps  # an optimizer of another kind gets fresh arrays instead


def test_a_short_batch_runs_the_graph_traced_for_the_full_ones() -> None:
    """The step is traced once for any batch size (as fit's): the epoch's last, short batch is not a second
    trace in the first epoch."""
    stepper = stepper_for(_model())
    buckets = stepper.buckets(1 << 20)
    assert isinstance(buckets, GraphBuckets)
    _exchange(buckets, stepper, _batch(8), 1.0, _ring(lambda flat: flat))
    x, y = _batch(3)
    want = _stepped(stepper, stepper.gradients(x, y))
    _, totals, _ = _exchange(buckets, stepper, (x, y), 3 / 8, _ring(lambda flat: flat))  # one rank: its own mean
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

    def mean_written_back(parts: list[np.ndarray], out: list[np.ndarray]) -> None:
        sent.extend(p.copy() for p in parts)
        for o in out:
            o[...] = 0.5  # what the ring leaves there: the other rank's rows averaged in

    for _ in range(3):
        _exchange(buckets, stepper, None, 0.0, mean_written_back)
    assert sent and not any(s.any() for s in sent)


class _Unused(keras.layers.Layer):
    """Two weights of one shape that nothing reads: their gradients are None, sent as zeros made alike (which
    TensorFlow may fold into one buffer handed to the ring twice)."""

    def build(self, input_shape):
        self.a = self.add_weight(shape=(4,), initializer="ones")
        self.b = self.add_weight(shape=(4,), initializer="ones")

    def call(self, x):
        return x


def test_weights_without_gradients_go_as_zeros_and_stay_as_they_were() -> None:
    def model() -> keras.Model:
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input(shape=(6,)), _Unused(), keras.layers.Dense(3, activation="softmax")])
        m.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return m

    ours, theirs = model(), model()
    stepper, reference = stepper_for(ours), stepper_for(theirs)
    buckets = stepper.buckets(1 << 20)
    assert isinstance(buckets, GraphBuckets)
    x, y = _batch()
    for _ in range(2):
        _, totals, bad = _exchange(buckets, stepper, (x, y), 1.0, _ring(lambda flat: flat))
        assert totals == [1.0] and not bad
        reference.step(x, y)
        reference.end()
    for a, b in zip(ours.weights, theirs.weights):
        np.testing.assert_allclose(np.asarray(a.numpy()), np.asarray(b.numpy()), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(ours.layers[0].a.numpy()), np.ones(4, np.float32))


def test_in_shared_memory_every_gradient_lies_on_a_cache_line_and_the_gaps_are_zeros() -> None:
    """The views TensorFlow reads from the host's shared memory each start on a cache line (else it would copy
    them): the parts go to the ring with zero gaps between them, and each bucket has its own tag."""
    stepper = stepper_for(_model())
    buckets = stepper.buckets(64)
    share = _Shared()
    x, y = _batch()
    want = _stepped(stepper, stepper.gradients(x, y))
    _, totals, bad = _exchange(buckets, stepper, (x, y), 1.0, _ring(lambda flat: flat), share)
    assert totals == [1.0, 1.0] and not bad
    _assert_weights(stepper, want)
    assert [tag for tag, _ in share.calls] == [1, 2]
    assert buckets._out == [None, None]  # no output arrays made where every result is read in shared memory
    for (tag, sizes), m in zip(share.calls, buckets.members):
        grads, gaps = sizes[:-1:2], sizes[1:-1:2]
        assert grads == [buckets.sizes[i] for i in m] and sizes[-1] == 1
        assert all((g + p) % (ALIGN // 4) == 0 for g, p in zip(grads, gaps))
        region = share.regions[tag]
        at = 0
        for g, p in zip(grads, gaps):
            assert not region[at + g : at + g + p].any()
            at += g + p
        assert region[at] == 1.0  # the weight's element, on a cache line too


def test_a_model_of_more_buckets_than_the_host_keeps_regions_for_gets_output_arrays() -> None:
    """A host's node keeps SHARED_BUCKETS + 1 shared-memory files: with more buckets the means go into output
    arrays (else every call would make a new file and every bucket's region would be held at once)."""
    from ddlf.training.replica.graph_buckets import SHARED_BUCKETS

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input(shape=(6,))]
        + [keras.layers.Dense(4, activation="relu") for _ in range(SHARED_BUCKETS)]
        + [keras.layers.Dense(3, activation="softmax")]
    )
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    stepper = stepper_for(model)
    buckets = stepper.buckets(4)  # a bucket per variable
    assert len(buckets.members) > SHARED_BUCKETS
    share = _Shared()
    x, y = _batch()
    want = _stepped(stepper, stepper.gradients(x, y))
    _, totals, _ = _exchange(buckets, stepper, (x, y), 1.0, _ring(lambda flat: flat), share)
    assert not share.calls and totals == [1.0] * len(buckets.members)
    _assert_weights(stepper, want)
