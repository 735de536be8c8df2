"""``Cluster.reset()`` and ``ddlf reset``: every worker back to the state it started in, without a restart
(``ddlf.worker.reset``), one kind of state per test; refused while a training run is held; a worker lost during
it reported as any call reports it."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import ddlf
from ddlf.training.membership import Members

from ..conftest import POOL, pooled
from .apps import SmallMnist


def _warm_models() -> int:
    from ddlf.training.replica import warm

    return len(warm._KEPT)


def _runs() -> list[dict[str, Any]]:
    from ddlf.training import replica

    return replica.runs()


def _watch_warm_models() -> int:
    """Weak references to the models this worker keeps warm, kept where a reset leaves them (a module of the
    worker's own); how many."""
    import types
    import weakref

    from ddlf.training.replica import warm

    watch = sys.modules.setdefault("_ddlf_test_watches_models", types.ModuleType("_ddlf_test_watches_models"))
    watch.refs = [weakref.ref(model) for model, _ in warm._KEPT.values()]  # type: ignore[attr-defined]
    return len(watch.refs)  # type: ignore[attr-defined]


def _watched_models_alive() -> int:
    return sum(ref() is not None for ref in sys.modules["_ddlf_test_watches_models"].refs)  # type: ignore[attr-defined]


def _datasets() -> list[str]:
    from ddlf.data.store import STORE

    return STORE.keys()


def _node_store_entries() -> list[str]:
    from ddlf.data import node_store

    base = node_store.root()
    return sorted(f for f in os.listdir(base) if not f.endswith(".lock")) if base and os.path.isdir(base) else []


def test_variables_functions_and_the_exec_namespace_are_dropped(cluster: ddlf.Cluster) -> None:
    cluster.set("lr", 0.1)
    cluster.add_function(_datasets)
    cluster.exec("answer = 42")
    dropped = cluster.reset()
    assert [d["variables"] for d in dropped] == [1, 1]
    assert cluster.variables() == [[], []]
    assert cluster.functions() == [[], []]
    assert cluster.run(lambda worker: "answer" in worker.globals) == [False, False]
    cluster.set("lr", 0.2)  # the cluster works on after it: what was pushed before is pushed again when used
    assert cluster.get("lr") == [0.2, 0.2]
    assert cluster.run(_datasets) == [[], []]


class OwnMnist(SmallMnist):
    """Its own dataset key: no other worker of this host (a spare of the pool, another test process's) holds the
    host's copy that the reset must remove."""

    dataset_key = "reset-test-mnist"


def test_datasets_warm_models_and_the_hosts_copies_are_dropped(cluster: ddlf.Cluster) -> None:
    app = OwnMnist(cluster)
    app.train(epochs=1, batch_size=64, strategy=ddlf.ModelAveraging(), verbose=0)
    assert cluster.run(_datasets) == [[OwnMnist.dataset_key]] * 2
    assert cluster.run(_warm_models) == [1, 1]
    assert cluster.run(_watch_warm_models) == [1, 1]
    assert any(e.startswith(OwnMnist.dataset_key) for e in cluster.run(_node_store_entries)[0])  # the host's copy
    dropped = cluster.reset()
    assert [d["datasets"] for d in dropped] == [[OwnMnist.dataset_key]] * 2
    assert [d["training"]["warm_models"] for d in dropped] == [1, 1]
    assert cluster.run(_datasets) == [[], []]
    assert cluster.run(_warm_models) == [0, 0]
    assert cluster.run(_watched_models_alive) == [0, 0]  # the models themselves freed, not only forgotten
    # (other workers of this host may hold other datasets' copies)
    assert not any(e.startswith(OwnMnist.dataset_key) for held in cluster.run(_node_store_entries) for e in held)
    history = OwnMnist(cluster).train(epochs=1, batch_size=64, strategy=ddlf.ModelAveraging(), verbose=0)
    assert not any(s["cached"] for s in history.params["setup"])  # loaded anew


def _custom_gradients() -> int:
    from ddlf.frameworks.tensorflow_graphs import custom_gradients

    return len(custom_gradients())


class WiderMnist(OwnMnist):
    """A model no earlier run traced: its training step is traced anew on each worker."""

    def create_model(self):
        import keras

        model = keras.Sequential(
            [keras.Input(shape=(784,)), keras.layers.Dense(48, activation="relu"), keras.layers.Dense(10, "softmax")]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


def _trace_a_custom_gradient() -> None:
    import tensorflow as tf

    @tf.custom_gradient
    def clipped(x):
        return tf.identity(x), lambda dy: tf.clip_by_value(dy, -1.0, 1.0)

    tf.function(lambda x: clipped(x)).get_concrete_function(tf.TensorSpec([2], tf.float32))


@pytest.mark.skipif(os.environ["KERAS_BACKEND"] != "tensorflow", reason="TensorFlow's gradient registry")
def test_what_tensorflow_keeps_of_each_traced_step_goes_with_the_runs(cluster: ddlf.Cluster) -> None:
    """Each trace of a Keras-on-TensorFlow training step registers a custom gradient, process-wide, whose closure
    holds the whole traced graph (about 2.5 MiB for a small MLP), and TensorFlow never removes it: a worker that
    served a new model per run grew by that much per run (RELIABILITY.md, the soak). The worker forgets the runs'
    registrations when its last run is torn down, and every one on reset."""
    cluster.reset()
    assert cluster.run(_custom_gradients) == [0, 0]
    for app in (WiderMnist, OwnMnist):  # two models: each worker traces a training step for each
        app(cluster).train(epochs=1, batch_size=64, strategy=ddlf.ModelAveraging(), verbose=0)
        assert cluster.run(_custom_gradients) == [0, 0]
    assert cluster.run(_warm_models) == [2, 2]  # both kept: their traced steps train without the registrations
    history = WiderMnist(cluster).train(epochs=1, batch_size=64, strategy=ddlf.ModelAveraging(), verbose=0)
    assert history.history["loss"][0] < 2.0 and history.history["accuracy"][0] > 0.5
    # A registration of the user's own (a function traced outside any run) stays until the reset.
    cluster.run(_trace_a_custom_gradient)
    assert cluster.run(_custom_gradients) == [1, 1]
    dropped = cluster.reset()
    assert [d["custom_gradients"] for d in dropped] == [1, 1]
    assert cluster.run(_custom_gradients) == [0, 0]


def test_keras_session_and_random_generators_start_afresh(cluster: ddlf.Cluster) -> None:
    def dense_name() -> str:
        import keras

        return keras.layers.Dense(1).name

    def seeded_draw() -> float:
        np.random.seed(0)
        return float(np.random.random())

    cluster.run(dense_name)
    assert cluster.run(dense_name)[0] != "dense"  # Keras numbers its layers per session: dense_1, ...
    seeded = cluster.run(seeded_draw)[0]
    cluster.reset()
    assert cluster.run(dense_name) == ["dense", "dense"]
    assert cluster.run(lambda: float(np.random.random()))[0] != seeded  # reseeded, not left at seed 0's stream


def _jit_kept_past_the_reset() -> int:
    """A jitted function compiled once, kept where a reset leaves it (a module of the worker's own); its compiled
    versions now."""
    import types

    import jax
    import jax.numpy as jnp

    keep = sys.modules.setdefault("_ddlf_test_keeps_a_jit", types.ModuleType("_ddlf_test_keeps_a_jit"))
    if not hasattr(keep, "double"):
        keep.double = jax.jit(lambda x: x * 2)  # type: ignore[attr-defined]
        keep.double(jnp.ones(3))  # type: ignore[attr-defined]
    return int(keep.double._cache_size())  # type: ignore[attr-defined]


def test_jaxs_compiled_functions_are_dropped(daemon: Any) -> None:
    pytest.importorskip("jax")
    with ddlf.Cluster([daemon.address], daemon.token) as c:
        assert c.run(_jit_kept_past_the_reset) == [1]
        c.reset()
        assert c.run(_jit_kept_past_the_reset) == [0]  # the function is there; what JAX compiled for it is not


def test_uploaded_modules_are_forgotten_and_shipped_again(cluster: ddlf.Cluster, tmp_path: Any) -> None:
    module = tmp_path / "reset_helper_mod.py"
    module.write_text("VALUE = 7\n")
    cluster.upload_module(str(module))
    assert cluster.run(lambda: __import__("reset_helper_mod").VALUE) == [7, 7]
    dropped = cluster.reset()
    assert all("reset_helper_mod" in d["modules"] for d in dropped)

    def importable() -> bool:
        try:
            __import__("reset_helper_mod")
        except ImportError:
            return False
        return True

    assert cluster.run(importable) == [False, False]
    module.write_text("VALUE = 8\n")
    cluster.upload_module(str(module))
    assert cluster.run(lambda: __import__("reset_helper_mod").VALUE) == [8, 8]


def test_a_run_held_by_another_master_refuses_the_reset_unless_forced(cluster: ddlf.Cluster) -> None:
    app = SmallMnist(cluster)
    app.model = app.create_model()
    left = Members(app, "run-left-behind", 0, ddlf.History())
    assert left.live(first=True) == [0, 1]  # set up on both workers, never torn down (its master died)
    cluster.set("kept", 1)
    with pytest.raises(ddlf.ResetRefused, match=r"run-left-behind \(SmallMnist, idle \d+ s\).*force=True"):
        cluster.reset()
    assert cluster.get("kept") == [1, 1]  # nothing was reset
    dropped = cluster.reset(force=True)
    assert [d["training"]["runs"] for d in dropped] == [["run-left-behind"]] * 2
    assert cluster.run(_runs) == [[], []]
    assert cluster.status()[0]["runs"] == []


def test_a_worker_lost_during_the_reset_is_reported_as_lost() -> None:
    with pooled(2, spare=True) as c:
        c.set("kept", 1)
        victim = POOL.pid(1, spare=True)
        os.kill(victim, 9)
        os.waitpid(victim, 0)
        with pytest.raises(ddlf.WorkerUnavailable):
            c.reset()
        assert c.lost_workers == [1]
        assert c.run_on(0, lambda worker: sorted(worker.vars)) == []  # the survivor was reset


def test_ddlf_reset_on_the_command_line(cluster: ddlf.Cluster) -> None:
    cluster.set("kept", 1)
    env = {**os.environ, "DDLF_TOKEN": cluster.token or ""}
    done = subprocess.run(
        [sys.executable, "-m", "ddlf.cli", "reset", *cluster.addresses],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": reset (") == 2 and "1 variables" in done.stdout
    assert cluster.variables() == [[], []]
