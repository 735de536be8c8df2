"""The master's model is the truth of every ``train()``, and ``train()`` takes what ``fit`` takes: what the user
changes on the master's model between runs (a recompile with
another optimizer or rate, an unfrozen base, a learning rate set by hand, a preprocessing layer adapted to other
data, a torch optimizer's ``param_groups``) is what the workers train with, as the next ``fit`` (or torch loop) in
one process would; a warm model is lent only when it matches (:mod:`ddlf.frameworks.model_spec`); a model ``fit``
builds on its first batch trains; lists and pandas from ``load_dataset`` train, strings are refused before any
round; ``stop_training`` set in a batch ends training at the round's end."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import ddlf

from .apps import SEPARABLE_ROWS, flat, separable

ROWS = SEPARABLE_ROWS
BATCH = 32
STEPS = ROWS // 2 // BATCH  # batches a worker trains per epoch (two workers)


class Binary(ddlf.IApp):
    """A base (a Dense layer, frozen when ``frozen``) and a head, Adam(1e-3)."""

    frozen = False

    def load_dataset(self) -> Any:
        return separable()

    def create_model(self) -> Any:
        import keras

        base = keras.layers.Dense(16, activation="relu", name="base")
        base.trainable = not self.frozen
        model = keras.Sequential([keras.Input(shape=(8,)), base, keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy", metrics=["accuracy"])
        return model


class Frozen(Binary):
    dataset_key = "model-truth-binary"
    frozen = True


class Normalized(ddlf.IApp):
    """A model whose ``create_model`` adapts a ``Normalization`` layer to the app's own data (offset ``shift``,
    scale ``scale``): two such apps share an architecture and a configuration, not their constants."""

    shift = 0.0
    scale = 1.0

    def load_dataset(self) -> Any:
        return separable(self.shift, self.scale)

    def adapt_to(self) -> np.ndarray:
        return separable(self.shift, self.scale)[0]

    def create_model(self) -> Any:
        import keras

        norm = keras.layers.Normalization()
        norm.adapt(self.adapt_to())
        model = keras.Sequential(
            [keras.Input(shape=(8,)), norm, keras.layers.Dense(16, "relu"), keras.layers.Dense(1, "sigmoid")]
        )
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=["accuracy"])
        return model


class Plain(Normalized):
    dataset_key = "model-truth-plain"


class Shifted(Normalized):
    dataset_key = "model-truth-shifted"
    shift = 40.0
    scale = 25.0


STRATEGIES = {
    "model averaging": lambda: ddlf.ModelAveraging(every=4),
    "gradient averaging": lambda: ddlf.GradientAveraging(scale_learning_rate=False),
    "asynchronous": lambda: ddlf.Asynchronous(),
}


def _train(app: ddlf.IApp, strategy: str, epochs: int = 1, **kw: Any) -> ddlf.History:
    return app.train(
        epochs=epochs, batch_size=BATCH, strategy=STRATEGIES[strategy](), run=ddlf.RunConfig(seed=3), verbose=0, **kw
    )


def _moved(before: list[np.ndarray], after: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(a - b))) for a, b in zip(before, after))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fine_tuning_unfreezes_the_base_and_trains_at_the_recompiled_rate(cluster: ddlf.Cluster, strategy: str) -> None:
    """Keras' transfer-learning recipe: train the head with the base frozen, set ``base.trainable = True``,
    recompile with ``Adam(1e-5)``, train again. As in one process, the base moves, and nothing moves faster than
    Adam at 1e-5 moves a weight (about the rate per step)."""
    import keras

    app = Frozen(cluster)
    _train(app, strategy)
    model = app.model
    base = model.get_layer("base")
    assert not base.trainable_weights  # trained frozen
    start_base = [np.array(w) for w in base.get_weights()]
    start = [np.array(w) for w in model.get_weights()]
    base.trainable = True
    model.compile(optimizer=keras.optimizers.Adam(1e-5), loss="binary_crossentropy", metrics=["accuracy"])
    history = _train(app, strategy)
    for setup in history.params["setup"]:  # what each worker's replica took from the master's model
        assert "trainable" in setup["model_changes"]
        assert "learning_rate" in setup["model_changes"]  # Adam again: only its rate differs (no recompile needed)
    moved_base = _moved(start_base, base.get_weights())
    moved = _moved(start, model.get_weights())
    # Adam moves a weight by about the rate per step (at most a few times it early on): STEPS steps per worker.
    bound = 4 * 1e-5 * STEPS * (2 if strategy == "asynchronous" else 1)
    assert 0 < moved <= bound, (moved, bound)
    assert moved_base > 1e-3 * bound, moved_base  # the base trains (frozen, it would not move at all)


@pytest.mark.parametrize("strategy", ["model averaging", "gradient averaging"])
def test_a_recompile_with_a_tiny_rate_barely_moves_the_weights(cluster: ddlf.Cluster, strategy: str) -> None:
    """``model.compile(SGD(1e-9))`` between two runs: the second run trains at 1e-9, as the next ``fit`` would."""
    import keras

    app = Binary(cluster)
    _train(app, strategy)
    start = [np.array(w) for w in app.model.get_weights()]
    app.model.compile(optimizer=keras.optimizers.SGD(1e-9), loss="binary_crossentropy", metrics=["accuracy"])
    _train(app, strategy)
    assert _moved(start, app.model.get_weights()) < 1e-6
    assert isinstance(app.model.optimizer, keras.optimizers.SGD)


def test_a_learning_rate_set_by_hand_between_runs_reaches_the_workers(cluster: ddlf.Cluster) -> None:
    """``model.optimizer.learning_rate = 0`` between two runs (no recompile): nothing moves in the second, while the
    warm model is still lent (only a rate changed: nothing traced again)."""
    app = Binary(cluster)
    _train(app, "gradient averaging")
    start = [np.array(w) for w in app.model.get_weights()]
    app.model.optimizer.learning_rate = 0.0
    history = _train(app, "gradient averaging")
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in start]), flat(app.model.get_weights()))
    assert any("learning_rate" in s.get("model_changes", []) for s in history.params["setup"])


def test_a_warm_model_adapted_to_other_data_is_not_lent(cluster: ddlf.Cluster) -> None:
    """Two apps of one architecture whose ``Normalization`` layers adapted to different data (``Shifted``'s rows
    are ``Plain``'s, shifted and scaled: normalized, they are the same rows). A warm model holds its normalization
    constants inside its traced step, so one adapted to the other app's data must not stand in: each app trains as
    it does alone, and so both learn the same."""
    plain = _train(Plain(cluster), "gradient averaging", epochs=2)
    shifted = _train(Shifted(cluster), "gradient averaging", epochs=2)  # after Plain, on the same workers
    np.testing.assert_allclose(shifted.history["loss"], plain.history["loss"], rtol=1e-4)
    assert shifted.history["accuracy"][-1] > 0.85, shifted.history
    app = Plain(cluster)
    again = _train(app, "gradient averaging", epochs=2)  # its own warm model lent again: exactly as before
    np.testing.assert_array_equal(again.history["loss"], plain.history["loss"])
    norm = app.model.layers[0]  # and the master's model holds the normalization its own create_model adapted
    np.testing.assert_allclose(np.asarray(norm.mean).ravel(), separable()[0].mean(axis=0), atol=1e-4)


class Misadapted(Shifted):
    """``create_model`` adapts its ``Normalization`` to the wrong data (unshifted): the user adapts the master's
    model again, to the rows the workers hold."""

    def adapt_to(self) -> np.ndarray:
        return separable()[0]


def test_the_masters_adapted_state_is_what_the_workers_normalize_with(cluster: ddlf.Cluster) -> None:
    """A ``Normalization`` layer adapted again on the master between ``create_model`` and ``train``: the workers'
    replicas take its constants, as ``fit`` would train with them, and the trained model scores on the master."""
    app = Misadapted(cluster)
    app.model = app.create_model()
    norm = app.model.layers[0]
    norm.adapt(separable(Shifted.shift, Shifted.scale)[0])  # the user fixes it on the master
    history = _train(app, "gradient averaging", epochs=2)
    for setup in history.params["setup"]:
        assert any(c.startswith("preprocessing:") for c in setup["model_changes"]), setup
    x, y = separable(Shifted.shift, Shifted.scale)
    assert app.evaluate(x, y, return_dict=True)["accuracy"] > 0.85
    np.testing.assert_allclose(np.asarray(norm.mean).ravel(), x.mean(axis=0), rtol=1e-3, atol=1e-3)


class SubclassedBinary(Binary):
    """A ``keras.Model`` subclass with only ``call()``: ``fit`` builds it on its first batch."""

    def create_model(self) -> Any:
        import keras

        class TwoLayers(keras.Model):
            def __init__(self) -> None:
                super().__init__()
                self.hidden = keras.layers.Dense(16, activation="relu")
                self.out = keras.layers.Dense(1, activation="sigmoid")

            def call(self, x: Any) -> Any:
                return self.out(self.hidden(x))

        model = TwoLayers()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=["accuracy"])
        return model


class NoInputBinary(Binary):
    """``Sequential([Dense(16), Dense(1)])`` without ``keras.Input``: built on the first batch too."""

    def create_model(self) -> Any:
        import keras

        model = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1, "sigmoid")])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=["accuracy"])
        return model


@pytest.mark.parametrize("app_class", [SubclassedBinary, NoInputBinary])
@pytest.mark.parametrize("strategy", [None, "model averaging", "asynchronous"])
def test_models_fit_builds_on_the_first_batch_train(
    cluster: ddlf.Cluster, app_class: type[ddlf.IApp], strategy: str | None
) -> None:
    """A model without weights until its first batch is built from the dataset's first rows, on the master and
    the workers alike, and trains as under ``fit`` (with the default strategy too)."""
    app = app_class(cluster)
    if strategy is None:
        history = app.train(epochs=3, batch_size=BATCH, run=ddlf.RunConfig(seed=3), verbose=0)
    else:
        history = _train(app, strategy, epochs=3)
    assert app.model.built and len(app.model.weights) == 4
    assert history.history["accuracy"][-1] > 0.85, history.history
    x, y = separable()
    assert app.evaluate(x, y, return_dict=True)["accuracy"] > 0.85


# -- data as fit takes it ---------------------------------------------------------------------------------------


class ListsBinary(Binary):
    """``load_dataset`` returns Python lists (``x.tolist()``), as ``fit`` takes them."""

    dataset_key = "model-truth-lists"

    def load_dataset(self) -> Any:
        x, y = separable()
        return x.tolist(), y.tolist()


class PandasBinary(Binary):
    """``load_dataset`` returns a pandas DataFrame and Series."""

    dataset_key = "model-truth-pandas"

    def load_dataset(self) -> Any:
        import pandas as pd

        x, y = separable()
        return pd.DataFrame(x, columns=[f"f{i}" for i in range(8)]), pd.Series(y)


class TextBinary(Binary):
    """``load_dataset`` returns numpy strings for the model (which takes numbers)."""

    dataset_key = "model-truth-text"

    def load_dataset(self) -> Any:
        x, y = separable()
        return np.array([" ".join(f"{v:.2f}" for v in row) for row in x]), y


@pytest.mark.parametrize("app_class", [ListsBinary, PandasBinary])
def test_lists_and_pandas_from_load_dataset_train_as_arrays(cluster: ddlf.Cluster, app_class: type) -> None:
    if app_class is PandasBinary:
        pytest.importorskip("pandas")
    reference = _train(Binary(cluster), "model averaging", epochs=2)
    history = _train(app_class(cluster), "model averaging", epochs=2)
    np.testing.assert_allclose(history.history["loss"], reference.history["loss"], rtol=1e-5)


def test_strings_for_a_model_are_refused_before_training_naming_the_part(cluster: ddlf.Cluster) -> None:
    with pytest.raises(ddlf.DdlfError, match=r"x as load_dataset returned holds strings \(dtype <U\d+\).*numbers"):
        _train(TextBinary(cluster), "model averaging")
    assert cluster.ping()  # the workers still serve, and nothing of the refused run stays
    assert all(not runs for runs in cluster.call(_runs))
    assert _train(Binary(cluster), "model averaging").history["accuracy"]


def _runs() -> list:
    from ddlf.training import replica

    return replica.runs()


# -- stop_training ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_stop_training_set_in_a_batch_ends_training_at_the_next_round(cluster: ddlf.Cluster, strategy: str) -> None:
    """A Keras callback sets ``model.stop_training`` in ``on_train_batch_end`` of the first epoch: as ``fit`` stops
    at that batch, training ends at the round's end (not the epoch's), with the epoch's logs of what trained."""
    import keras

    class StopEarly(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.model.stop_training = True

    app = Binary(cluster)
    if strategy == "gradient averaging":  # its round is an epoch's partition unless the workers check in sooner
        history = app.train(
            epochs=3,
            batch_size=BATCH,
            strategy=ddlf.GradientAveraging(check_in_every=4),
            callbacks=[StopEarly()],
            verbose=0,
        )
    else:
        history = _train(app, strategy, epochs=3, callbacks=[StopEarly()])
    assert len(history.history["loss"]) == 1 and np.isfinite(history.history["loss"][0])
    trained = sum(s.samples for s in history.stats)
    assert 0 < trained < ROWS, trained  # part of the first epoch, not all of it
    assert app.epochs_done == 1


# -- what else the master's model carries ---------------------------------------------------------------------------


def test_the_scripts_global_dtype_policy_is_the_workers(cluster: ddlf.Cluster) -> None:
    """``keras.config.set_dtype_policy("mixed_float16")`` in the script, before ``create_model``: the workers build
    their replicas under it too (their configuration is the master's: no warning)."""
    import warnings

    import keras

    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        app = Binary(cluster)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ddlf.ModelChangeWarning)
            history = _train(app, "gradient averaging")
    finally:
        keras.config.set_dtype_policy(before)
    assert app.model.layers[0].dtype_policy.name == "mixed_float16"
    assert all(s["model_mismatch"] is None for s in history.params["setup"])
    assert np.isfinite(history.history["loss"][0])


def test_a_master_model_of_another_architecture_warns(cluster: ddlf.Cluster) -> None:
    """The master's model replaced by hand with one of other activations (the same weight shapes): the workers
    train ``create_model()``'s, and ddlf says so rather than train it silently."""
    import keras

    app = Binary(cluster)
    app.model = keras.Sequential(
        [
            keras.Input(shape=(8,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    app.model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy", metrics=["accuracy"])
    with pytest.warns(ddlf.ModelChangeWarning, match="another configuration than the master's model"):
        history = _train(app, "model averaging")
    assert any(e["event"] == "model_mismatch" for e in history.events)


def test_a_master_model_whose_weights_do_not_fit_is_refused_naming_the_weight(cluster: ddlf.Cluster) -> None:
    """The master's model replaced by hand with wider layers: the workers build ``create_model()``'s, which cannot
    take its weights. Refused before any round, naming the first weight that differs; the workers still train."""
    import keras

    app = Binary(cluster)
    app.model = keras.Sequential(
        [keras.Input(shape=(8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1, "sigmoid")]
    )
    app.model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    with pytest.raises(ddlf.ModelMismatchError, match=r"weight 0 is \(8, 32\) on the master, \(8, 16\) here"):
        _train(app, "gradient averaging")
    app.model = app.create_model()
    assert len(_train(app, "gradient averaging").history["loss"]) == 1


def test_a_layer_frozen_without_a_recompile_says_to_recompile(cluster: ddlf.Cluster) -> None:
    """A layer frozen after a run without compiling again: the master's optimizer holds state for every weight,
    the workers' trains fewer. The error says what to do (it blamed create_model), and doing it trains."""
    import keras

    app = Binary(cluster)
    _train(app, "gradient averaging")
    app.model.get_layer("base").trainable = False
    with pytest.raises(ddlf.ModelMismatchError, match="compile the model again with a new optimizer"):
        _train(app, "gradient averaging")
    app.model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    base = [np.array(w) for w in app.model.get_layer("base").get_weights()]
    _train(app, "gradient averaging")
    assert _moved(base, app.model.get_layer("base").get_weights()) == 0.0


def test_a_recompile_during_train_is_warned_of_and_taken_by_the_next_train(cluster: ddlf.Cluster) -> None:
    """A callback that recompiles the master's model (``SGD(1e-9)``) after the first epoch: the workers keep the
    model they set up with until this ``train()`` ends (ddlf says so), and the next ``train()`` takes it."""
    import keras

    app = Binary(cluster)

    class Recompile(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if epoch == 0:
                self.model.compile(optimizer=keras.optimizers.SGD(1e-9), loss="binary_crossentropy")

    with pytest.warns(ddlf.ModelChangeWarning, match=r"changed during train\(\) \(its compile, in epoch 0\)"):
        history = _train(app, "model averaging", epochs=2, callbacks=[Recompile()])
    assert [e["parts"] for e in history.events if e["event"] == "model_changed"] == [["compile"]]
    start = [np.array(w) for w in app.model.get_weights()]
    _train(app, "model averaging")
    assert _moved(start, app.model.get_weights()) < 1e-6


class HalfText(Binary):
    """Strings on worker 1 only: one worker sets the run up, the other refuses it."""

    dataset_key = "model-truth-half-text"

    def load_dataset(self) -> Any:
        x, y = separable()
        return (x.astype(str) if os.environ.get("DDLF_HALF_TEXT") == "1" else x), y


def _half_text(on: bool) -> None:
    """Worker 1 loads strings, and keeps them to itself: with the host's node store on, it would map the numbers
    worker 0 wrote there (ddlf.data.node_store) instead of loading its own."""
    if on:
        os.environ["DDLF_HALF_TEXT"] = "1"
        os.environ["DDLF_HALF_TEXT_STORE"] = os.environ.get("DDLF_NODE_STORE", "")
        os.environ["DDLF_NODE_STORE"] = "off"
    else:
        del os.environ["DDLF_HALF_TEXT"]
        store = os.environ.pop("DDLF_HALF_TEXT_STORE")
        if store:
            os.environ["DDLF_NODE_STORE"] = store
        else:
            del os.environ["DDLF_NODE_STORE"]


def test_a_run_refused_by_one_worker_is_forgotten_by_the_others(cluster: ddlf.Cluster) -> None:
    cluster.run_on(1, _half_text, True)
    try:
        with pytest.raises(ddlf.DdlfError, match="holds strings"):
            _train(HalfText(cluster), "model averaging")
    finally:
        cluster.run_on(1, _half_text, False)
        cluster.drop_dataset(HalfText.dataset_key)
    assert cluster.run(_runs) == [[], []]  # worker 0 had set it up: torn down with the refusal


class Still(Binary):
    """Trained with ``SGD(0)``: the weights stay where they are put."""

    def create_model(self) -> Any:
        import keras

        model = super().create_model()
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="binary_crossentropy")
        return model


@pytest.mark.parametrize("hook", ["on_epoch_end", "on_epoch_begin"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_weights_a_callback_sets_during_train_are_what_the_workers_train_on(
    cluster: ddlf.Cluster, strategy: str, hook: str
) -> None:
    """A callback that sets the master's weights during ``train()`` (a reset, an average swapped in) changes the
    model that trains, as in ``fit``: with a rate of 0 the run ends with exactly those weights (they were lost to
    the workers' copy at the next epoch's end)."""
    import keras

    app = Still(cluster)
    app.model = app.create_model()
    target = [np.full_like(w, 0.25) for w in app.model.get_weights()]
    at = 0 if hook == "on_epoch_end" else 1

    def set_weights(epoch: int, logs: Any = None) -> None:
        if epoch == at:
            app.model.set_weights(target)

    history = _train(app, strategy, epochs=3, callbacks=[keras.callbacks.LambdaCallback(**{hook: set_weights})])
    for got, want in zip(app.model.get_weights(), target):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert [e["epoch"] for e in history.events if e["event"] == "weights_set"] == [at]


def _replicas(run_id: str) -> list[list[np.ndarray]]:
    """The weights each set-up worker's replica of run ``run_id`` holds after its last round."""
    from ddlf.training.replica.registry import SESSIONS

    session = SESSIONS.by_id.get(run_id)
    return [] if session is None or session.reduced is None else [session.reduced[2]]


def test_weights_set_while_a_worker_joins_leave_every_replica_the_same() -> None:
    """Gradient averaging, a callback setting the weights at an epoch's end as a worker joins: the members go on
    from the set weights with their optimizer state, the new one adopts it (it trained with a fresh one, and the
    replicas drifted apart, silently, when every member restarted as a new one), so all hold the same weights."""
    from ddlf.training.callbacks import Callback

    from ..conftest import POOL, pool_addresses

    first, second, extra = pool_addresses(3, spare=True)
    held: list[list[np.ndarray]] = []

    class SetAndAdd(Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if epoch == 0:
                self.app.model.set_weights([w * 0.5 for w in self.app.model.get_weights()])
                cluster.add_worker(extra)
            else:
                held.extend(r for per in cluster.run(_replicas, self.history.params["run_id"]) for r in per)

    with ddlf.Cluster([first, second], token=POOL.token) as cluster:
        app = Binary(cluster)
        strategy = ddlf.GradientAveraging(scale_learning_rate=False)
        history = app.train(epochs=2, batch_size=BATCH, strategy=strategy, verbose=0, callbacks=[SetAndAdd()])
    assert [e["event"] for e in history.events if e["event"] in ("added", "weights_set")] == ["weights_set", "added"]
    assert len(held) == 3
    for replica in held[1:]:
        for a, b in zip(held[0], replica):
            np.testing.assert_array_equal(a, b)
