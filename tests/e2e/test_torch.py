"""ddlf.models.TorchModel: a torch.nn.Module trained with the same API as a Keras model (skipped without torch)."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import ddlf
from ddlf.frameworks import loading
from ddlf.frameworks.torch_model import TorchModel

from ..conftest import MNIST_DIR, pooled
from ..unit.training.test_sharded import OneRank  # a ring of one, for the shard optimizers without daemons
from .apps import SmallMnist

torch = pytest.importorskip("torch")


def _mlp() -> TorchModel:
    module = torch.nn.Sequential(
        torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 10)
    )
    return TorchModel(module, lambda p: torch.optim.Adam(p, lr=1e-3), torch.nn.CrossEntropyLoss())


class TorchMnist(SmallMnist):
    """The Keras tests' small MNIST app, with a torch MLP instead."""

    def create_model(self):
        return _mlp()


@pytest.fixture(scope="module")
def mnist_test_split():
    _, (xt, yt) = ddlf.datasets.mnist(MNIST_DIR)
    return xt[:2000], yt[:2000]


def test_weights_round_trip_and_bad_weights_are_refused() -> None:
    a, b = _mlp(), _mlp()
    w = a.get_weights()
    assert [x.shape for x in w] == [(32, 784), (32,), (10, 32), (10,)]
    assert all(x.dtype == np.float32 for x in w)
    b.set_weights(w)
    for x, y in zip(w, b.get_weights()):
        np.testing.assert_array_equal(x, y)
    w[0][0, 0] += 1.0  # a copy: changing it leaves the model alone
    assert a.get_weights()[0][0, 0] != w[0][0, 0]
    frozen = [x.copy() for x in w]
    for x in frozen:
        x.setflags(write=False)  # arrays that arrived over the wire are read-only
    b.set_weights(frozen)
    np.testing.assert_array_equal(b.get_weights()[0], frozen[0])
    with pytest.raises(ValueError, match="expected 4 weight arrays, got 3"):
        b.set_weights(w[:3])
    with pytest.raises(ValueError, match="does not fit"):
        b.set_weights([w[1], w[0], w[2], w[3]])
    with pytest.raises(ValueError, match="unknown metrics"):
        TorchModel(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.MSELoss(), metrics=["auc"])
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        TorchModel(lambda x: x, lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.MSELoss())
    with pytest.raises(
        ddlf.ConfigTypeError, match=r"torch\.optim\.Optimizer or a function returning one .* not 'adam'"
    ):
        TorchModel(torch.nn.Linear(2, 2), "adam", torch.nn.MSELoss())  # Keras's spelling: 'str' was not callable


def test_train_on_batch_evaluate_and_optimizer_state(tmp_path) -> None:
    m = _mlp()
    rng = np.random.default_rng(0)
    x = rng.random((64, 784), dtype=np.float32)
    y = rng.integers(0, 10, 64)
    assert not m.optimizer_built and m.get_optimizer_state() == []
    first = m.train_on_batch(x, y, return_dict=True)
    assert set(first) == {"loss", "accuracy"} and first["loss"] > 0
    for _ in range(30):
        logs = m.train_on_batch(x, y, return_dict=True)
    assert logs["loss"] < first["loss"]  # the running mean falls as it fits the batch
    loss, acc = m.evaluate(x, y, batch_size=16)
    assert acc > 0.5 and loss < first["loss"]
    with pytest.raises(ValueError, match="no sample weights"):  # not silently unweighted
        m.evaluate(x, y, sample_weight=np.ones(64))
    assert m.predict(x).shape == (64, 10)
    state = m.get_optimizer_state()
    # which of the 4 tensors hold a state (all), then Adam's exp_avg, exp_avg_sq and step for each
    assert m.optimizer_built and state[0].tolist() == [True] * 4 and len(state) == 1 + 3 * 4
    other = _mlp()
    before = other.get_weights()
    assert other.set_optimizer_state(state[:-1]) is False  # another layout: refused, and no state left behind
    assert not other.optimizer_built
    # Not stepped yet: it gets its state as a first step would, takes this one, and its parameters stay as they were.
    assert other.set_optimizer_state(state) is True
    for a, b in zip(before, other.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(state, other.get_optimizer_state()):
        np.testing.assert_array_equal(a, b)
    other.train_on_batch(x, y)
    assert float(other.get_optimizer_state()[3]) == float(state[3]) + 1  # Adam's step goes on from it
    m.save(tmp_path / "m.pt")
    fresh = _mlp()
    fresh.load_weights(tmp_path / "m.pt")
    np.testing.assert_array_equal(fresh.get_weights()[2], m.get_weights()[2])


@pytest.mark.slow
def test_torch_model_trains_sync_deterministically_and_evaluates(
    cluster: ddlf.Cluster, mnist_test_split, tmp_path
) -> None:
    runs = []
    for _ in range(2):
        app = TorchMnist(cluster)
        h = app.train(
            epochs=3,
            batch_size=32,
            validation_data=mnist_test_split,
            callbacks=[ddlf.callbacks.ModelCheckpoint(str(tmp_path / "torch-{epoch}.pt"), monitor="val_accuracy")],
            verbose=0,
            strategy=ddlf.ModelAveraging(every=20, optimizer_state=True),
            run=ddlf.RunConfig(seed=3),
        )
        runs.append(app.model.get_weights())
    assert set(h.history) >= {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert h.history["loss"][-1] < h.history["loss"][0]
    _, acc = app.evaluate(*mnist_test_split)
    assert acc > 0.80
    assert h.history["val_accuracy"][-1] == pytest.approx(acc)
    for a, b in zip(*runs):  # same seed, same data: the same weights, dropout included
        np.testing.assert_array_equal(a, b)
    assert sorted(os.listdir(tmp_path)) == ["torch-1.pt", "torch-2.pt", "torch-3.pt"]
    saved = _mlp()
    saved.load_weights(str(tmp_path / "torch-3.pt"))
    np.testing.assert_array_equal(saved.get_weights()[0], runs[1][0])


def test_torch_model_trains_async(cluster: ddlf.Cluster, mnist_test_split) -> None:
    app = TorchMnist(cluster)
    h = app.train(epochs=3, batch_size=32, verbose=0, strategy=ddlf.Asynchronous(chunk=5, staleness=ddlf.DynSGD()))
    assert len(h.history["loss"]) == 3
    _, acc = app.evaluate(*mnist_test_split)
    assert acc > 0.75  # async runs are not bit-reproducible: the same margin as the Keras async test
    assert max(s.staleness for s in h.stats) >= 1
    assert sum(s.samples for s in h.stats) == 3 * 3000


@pytest.mark.slow
@pytest.mark.skipif(not loading.clash_possible(), reason="needs TF, torch, triton")
@pytest.mark.fresh_daemons("daemons with and without a Keras preload: the order frameworks load in")
def test_torch_after_tensorflow_on_a_worker_is_an_error_not_an_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    # Self-contained on purpose: a reference to this module would import tests/conftest.py on the worker, which
    # loads PyTorch's compiler first itself.
    def torch_model():
        import torch

        from ddlf.frameworks.torch_model import TorchModel

        net = torch.nn.Linear(2, 2)
        return type(TorchModel(net, lambda p: torch.optim.Adam(p), torch.nn.MSELoss(), metrics=())).__name__

    def torch_after_tensorflow():
        import tensorflow  # noqa: F401

        return torch_model()

    def tensorflow_preloaded_then_torch():
        import sys

        import numpy as np
        import torch

        from ddlf.frameworks.torch_model import TorchModel

        # The preload loaded only the compiler's LLVM before TensorFlow (0.1 s, not the 3.3 s compiler) ...
        assert "tensorflow" in sys.modules and "torch._dynamo" not in sys.modules
        # ... and the compiler loads after TensorFlow: a TorchModel trains (its optimizer loads the compiler).
        model = TorchModel(torch.nn.Linear(2, 2), lambda p: torch.optim.Adam(p), torch.nn.MSELoss(), metrics=())
        loss = model.train_on_batch(np.ones((4, 2), np.float32), np.zeros((4, 2), np.float32))
        return type(model).__name__, "torch._dynamo" in sys.modules, bool(np.isfinite(loss))

    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")  # for the daemons (this process may run Keras on JAX)
    # A daemon preloading Keras on TensorFlow loads the LLVM of PyTorch's compiler first: TorchModel apps still work
    # there.
    with ddlf.Cluster.local(1, preload=None, worker_args=["--preload", "keras"]) as cluster:
        # A request that runs code waits for the preload (ddlf.worker.executor): TensorFlow is in by then.
        assert cluster.run(lambda: "tensorflow" in __import__("sys").modules) == [True], "the preload never loaded it"
        assert cluster.run(tensorflow_preloaded_then_torch) == [("TorchModel", True, True)]
    # Without the preload, TensorFlow loaded by user code first: a clear error, and the worker keeps serving.
    with ddlf.Cluster.local(1, preload=None) as cluster:
        with pytest.raises(ddlf.RemoteError, match="Load PyTorch first"):
            cluster.run(torch_after_tensorflow)
        assert cluster.run(lambda: "alive") == ["alive"]


# A notebook's order: Keras on TensorFlow imported first, then a TorchModel app trained. Its own process: this one
# loaded PyTorch's compiler first (conftest.py).
TENSORFLOW_THEN_TORCH = """
import sys

import keras  # TensorFlow backend
import numpy as np
import torch

import ddlf
from ddlf.models import TorchModel


class TorchApp(ddlf.IApp):
    dataset_key = "tensorflow-then-torch"
    built = False

    def load_dataset(self):
        x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
        return x, (x.sum(axis=1) > 2).astype(np.int64)

    def create_model(self):
        net = torch.nn.Linear(4, 2)
        # built: the optimizer is made before TorchModel could check (its constructor loads the compiler)
        optimizer = torch.optim.Adam(net.parameters()) if self.built else (lambda p: torch.optim.Adam(p))
        return TorchModel(net, optimizer, torch.nn.CrossEntropyLoss())


with ddlf.Cluster.local(1) as cluster:
    for built in (False, True):
        app = TorchApp(cluster)
        app.built = built
        try:
            app.train(epochs=1, batch_size=16, verbose=0)
        except ddlf.FrameworkClash as exc:
            print("refused:", built, exc)
    print("worker alive:", cluster.run(lambda: "yes"), "compiler loaded:", "torch._dynamo" in sys.modules)
"""


@pytest.mark.slow
@pytest.mark.skipif(not loading.clash_possible(), reason="needs TF, torch, triton")
def test_torch_after_tensorflow_in_the_master_is_an_error_not_an_abort(tmp_path) -> None:
    import subprocess
    import sys

    script = tmp_path / "notebook.py"
    script.write_text(TENSORFLOW_THEN_TORCH)
    env = {**os.environ, "KERAS_BACKEND": "tensorflow"}
    env.pop("DDLF_PRELOAD", None)  # what a user gets: workers preload Keras on TensorFlow
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)  # -6 (SIGABRT) before the guard
    assert "LLVM ERROR" not in out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(" TensorFlow is loaded")[0] for line in lines[:2]] == ["refused: False", "refused: True"]
    assert "Load PyTorch first" in lines[1] and "restart its kernel" in lines[1]
    assert lines[2] == "worker alive: ['yes'] compiler loaded: False"


# A PyTorch user's script: torch imported, Keras never. Neither Keras nor TensorFlow should load anywhere.
TORCH_ONLY = """
import sys

import numpy as np
import torch

import ddlf
from ddlf.models import TorchModel


class TorchApp(ddlf.IApp):
    def load_dataset(self):
        x = np.random.default_rng(0).random((256, 4), dtype=np.float32)
        return x, (x.sum(axis=1) > 2).astype(np.int64)

    def create_model(self):
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 2))
        return TorchModel(net, lambda p: torch.optim.Adam(p, lr=5e-2), torch.nn.CrossEntropyLoss())


# 4 epochs at 5e-2: the loss falls by 0.16 or more in every mode, asynchronous too on a loaded machine (2 epochs at
# 1e-2 fell by 0.02-0.03, within the asynchronous mode's run-to-run spread: it once rose in CI).
loaded = lambda: sorted(m for m in ("keras", "tensorflow") if m in sys.modules)
with ddlf.Cluster.local(2) as cluster:
    for strategy in (ddlf.ModelAveraging(), ddlf.GradientAveraging(), ddlf.Asynchronous()):
        h = TorchApp(cluster).train(epochs=4, batch_size=16, verbose=0, strategy=strategy)
        assert h.history["loss"][-1] < h.history["loss"][0], h.history
    print("workers:", cluster.run(loaded), "torch:", cluster.run(lambda: "torch" in sys.modules))
print("master:", loaded())
"""


@pytest.mark.slow
def test_a_torch_script_loads_neither_keras_nor_tensorflow_anywhere(tmp_path) -> None:
    """Seeding, warm models and the daemons' default preload leave Keras (and with it TensorFlow, 4-5 CPU-seconds
    and hundreds of MB per process) unloaded in a script that trains a TorchModel without importing Keras."""
    import subprocess
    import sys

    script = tmp_path / "torch_only.py"
    script.write_text(TORCH_ONLY)
    env = {k: v for k, v in os.environ.items() if k not in ("DDLF_PRELOAD", "KERAS_BACKEND")}
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    lines = out.stdout.splitlines()
    assert lines == ["workers: [[], []] torch: [True, True]", "master: []"]


# What a worker has loaded (a lambda, so that it travels by value: a reference to this module would import torch).
_loaded = lambda: tuple(m in __import__("sys").modules for m in ("torch", "torch._dynamo", "tensorflow"))  # noqa: E731


@pytest.mark.slow
@pytest.mark.fresh_daemons("daemons without a preload: what each run loads")
def test_workers_load_torchs_compiler_only_for_a_torch_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddlf.frameworks.loading import clash_possible

    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    # A Keras run on TensorFlow (its app's module does not import torch): torch stays out of the worker.
    with ddlf.Cluster.local(1, preload=None) as cluster:
        SmallMnist(cluster).train(epochs=1, batch_size=64, verbose=0)
        assert cluster.run(_loaded) == [(False, False, True)]
    # A TorchModel run: the master says so, and the worker loads torch's compiler before anything loads
    # TensorFlow (where the order matters: triton installed).
    with ddlf.Cluster.local(1, preload=None) as cluster:
        TorchMnist(cluster).train(epochs=1, batch_size=64, verbose=0)
        torch_in, compiler_in, _ = cluster.run(_loaded)[0]
        assert torch_in and compiler_in == clash_possible()


class TorchLinear(ddlf.IApp):
    """The gradient tests' synthetic task with a torch MLP and plain SGD (nothing random per step)."""

    dataset_key = "torch-gradients-linear"

    def load_dataset(self):
        rng = np.random.default_rng(7)
        x = rng.standard_normal((600, 12)).astype(np.float32)
        y = (x @ rng.standard_normal(12) > 0).astype(np.int64)
        return x, y

    def create_model(self):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        return TorchModel(module, lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.CrossEntropyLoss())


@pytest.mark.slow
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 1e-4, None])
def test_torch_model_gradient_averaging_equals_one_process(bucket_cap_mb: float | None) -> None:
    """25 MB: one bucket, sent during backward; 1e-4 MB (100 bytes): a bucket per parameter or two, launched
    in order while backward runs; None: one buffer after backward. All the same descent as one process."""
    from .apps import global_batches

    with pooled(2) as c:
        app = TorchLinear(c)
        app.model = app.create_model()
        start = app.model.get_weights()
        h = app.train(
            epochs=2,
            batch_size=16,
            verbose=0,
            strategy=ddlf.GradientAveraging(bucket_cap_mb=bucket_cap_mb),
            run=ddlf.RunConfig(seed=4),
        )
        assert h.params["bucket_cap_mb"] == bucket_cap_mb
        x, y = app.load_dataset()
        ref = app.create_model()
        ref.set_weights(start)
        for rows in global_batches(2, 16, 2, 4, None):
            ref.train_on_batch(x[rows], y[rows])
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(app.model.get_weights(), ref.get_weights()))
        assert diff < 2e-5, diff
        assert max(float(np.max(np.abs(a - b))) for a, b in zip(app.model.get_weights(), start)) > 100 * diff
        assert h.history["accuracy"][-1] > 0.8


def test_buckets_follow_backward_order_and_launch_in_order() -> None:
    """The unit of overlap, without a ring: buckets cut in reverse parameter order, launched strictly in order
    (each while backward still runs, the last after it), weights carried per bucket, NaN left out per bucket."""
    from ddlf.training.replica.buckets import Buckets

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    params = list(module.parameters())  # 192 + 16 + 32 + 2 floats
    buckets = Buckets(params, cap_bytes=100)
    assert buckets.members == [[3, 2], [1, 0]]  # 34 floats (136 bytes) fill the first bucket
    launched: list[tuple[int, bool]] = []

    def reduce(flat: np.ndarray) -> None:
        launched.append((flat.size, backward_running[0]))
        flat *= 2  # as if a second rank sent the same

    backward_running = [False]
    x = torch.randn(8, 12)

    def backward() -> None:
        backward_running[0] = True
        module.zero_grad()
        torch.nn.functional.cross_entropy(module(x), torch.zeros(8, dtype=torch.long)).backward()
        backward_running[0] = False

    grads, totals, bad = buckets.exchange(backward, 0.5, reduce)
    assert [n for n, _ in launched] == [35, 209]  # each with its weight as the last element
    assert launched[0][1]  # the last layer's bucket left while backward still ran
    assert totals == [1.0, 1.0] and not bad
    for g, p in zip(grads, params):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-6)  # (2 x 0.5 x grad) / (2 x 0.5)
    # A rank without a batch sends zeros with weight 0; a non-finite bucket is left out on its own.
    launched.clear()
    grads, totals, bad = buckets.exchange(None, 0.5, reduce)
    assert totals == [0.0, 0.0] and all(not g.any() for g in grads)
    poison = params[0].register_hook(lambda g: torch.full_like(g, float("nan")))  # only the first layer's grads
    grads, totals, bad = buckets.exchange(backward, 1.0, reduce)
    assert (
        bad and totals[1] == 0.0 and totals[0] == 2.0 and np.isfinite(np.concatenate([g.ravel() for g in grads])).all()
    )
    poison.remove()
    buckets.close()


# -- structured batches: inputs by name or position, several outputs, a loss per output -----------------------------


class TwoHeads(torch.nn.Module):
    """Two named inputs (``forward(image, extra)``), two outputs by name: class logits and a regression value."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(12 + 3, 16)
        self.digit = torch.nn.Linear(16, 2)
        self.size = torch.nn.Linear(16, 1)

    def forward(self, image, extra):
        h = torch.tanh(self.body(torch.cat([image, extra], dim=1)))
        return {"digit": self.digit(h), "size": self.size(h).squeeze(-1)}


class OneDict(TwoHeads):
    """The same network taking the whole dict (``forward(batch)``)."""

    def forward(self, batch):  # type: ignore[override]
        return super().forward(batch["image"], batch["extra"])


class ByPosition(TwoHeads):
    """The same network taking and returning tuples."""

    def forward(self, image, extra):
        out = super().forward(image, extra)
        return out["digit"], out["size"]


def _two_heads_data(n: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 15)).astype(np.float32)
    digit = (x[:, :12].sum(axis=1) > 0).astype(np.int64)
    size = x[:, 12:] @ np.array([1.0, -2.0, 0.5])  # float64: becomes float32 ("auto")
    return {"image": x[:, :12], "extra": x[:, 12:]}, {"digit": digit, "size": size}


def _sgd(p):
    return torch.optim.SGD(p, lr=0.1)


def test_named_inputs_and_a_loss_per_output_train_as_torch_computes() -> None:
    x, y = _two_heads_data()
    losses = {"digit": torch.nn.CrossEntropyLoss(), "size": torch.nn.MSELoss()}
    m = TorchModel(TwoHeads(), _sgd, losses, loss_weights={"size": 0.5})
    # torch by hand on the same start: the same gradients
    ref = TwoHeads()
    out = ref(**{k: torch.from_numpy(v) for k, v in x.items()})
    want = losses["digit"](out["digit"], torch.from_numpy(y["digit"])) + 0.5 * losses["size"](
        out["size"], torch.from_numpy(y["size"]).float()
    )
    want.backward()
    m._backward(x, y)
    for a, b in zip(m.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    logs = m.get_metrics_result()
    assert list(logs) == ["loss", "digit_loss", "size_loss", "digit_accuracy"]  # no accuracy for a regression
    assert (
        logs["loss"]
        == pytest.approx(float(want.detach()))
        == pytest.approx(logs["digit_loss"] + 0.5 * logs["size_loss"])
    )
    m.reset_metrics()
    first = m.train_on_batch(x, y, return_dict=True)
    for _ in range(100):
        logs = m.train_on_batch(x, y, return_dict=True)
    assert logs["loss"] < first["loss"] and logs["size_loss"] < first["size_loss"]
    evaluated = m.evaluate(x, y, batch_size=10, return_dict=True)
    assert list(evaluated) == list(logs) and evaluated["digit_accuracy"] > 0.8
    predicted = m.predict(x, batch_size=10)
    assert {k: v.shape for k, v in predicted.items()} == {"digit": (64, 2), "size": (64,)}
    assert predicted["size"].dtype == np.float32


def test_every_form_of_a_structured_batch_takes_the_same_steps() -> None:
    """The dict by keyword or whole, tuples by position, one loss over the structures or one per output: the same
    descent, and an array batch given as a 1-tuple the same as the array (the fast path)."""
    x, y = _two_heads_data()
    ce, mse = torch.nn.CrossEntropyLoss(), torch.nn.MSELoss()

    def whole(out, target):
        return ce(out["digit"], target["digit"]) + 0.5 * mse(out["size"], target["size"])

    forms = {
        "by keyword": (TorchModel(TwoHeads(), _sgd, {"digit": ce, "size": mse}, loss_weights={"size": 0.5}), x, y),
        "whole dict": (TorchModel(OneDict(), _sgd, {"digit": ce, "size": mse}, loss_weights={"size": 0.5}), x, y),
        "one loss": (TorchModel(TwoHeads(), _sgd, whole), x, y),
        "by position": (
            TorchModel(ByPosition(), _sgd, [ce, mse], loss_weights=[1.0, 0.5]),
            (x["image"], x["extra"]),
            (y["digit"], y["size"]),
        ),
    }
    logs = {}
    for name, (model, bx, by) in forms.items():
        for _ in range(5):
            logs[name] = model.train_on_batch(bx, by, return_dict=True)
    weights = {name: model.get_weights() for name, (model, _, _) in forms.items()}
    for name in forms:
        for a, b in zip(weights[name], weights["by keyword"]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=name)
    assert list(logs["whole dict"]) == ["loss", "digit_loss", "size_loss", "digit_accuracy"]
    assert list(logs["one loss"]) == ["loss", "digit_accuracy"]  # outputs and targets pair up by name
    assert list(logs["by position"]) == ["loss", "output_0_loss", "output_1_loss", "output_0_accuracy"]
    assert logs["by position"]["output_0_accuracy"] == logs["by keyword"]["digit_accuracy"]
    assert logs["by position"]["loss"] == pytest.approx(logs["by keyword"]["loss"])

    def mlp() -> TorchModel:  # no dropout: the two must match exactly
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        return TorchModel(net, lambda p: torch.optim.Adam(p, lr=1e-3), torch.nn.CrossEntropyLoss())

    array, packed = mlp(), mlp()
    rng = np.random.default_rng(1)
    bx, by = rng.random((32, 784), dtype=np.float32), rng.integers(0, 10, 32).astype(np.uint8)
    for _ in range(3):
        array_logs = array.train_on_batch(bx, by, return_dict=True)
        packed_logs = packed.train_on_batch((bx,), by, return_dict=True)
    assert array_logs == packed_logs and list(array_logs) == ["loss", "accuracy"]
    for a, b in zip(array.get_weights(), packed.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_targets_convert_per_output_and_accuracy_only_where_defined() -> None:
    x, y = _two_heads_data()
    ce, mse = torch.nn.CrossEntropyLoss(), torch.nn.MSELoss()
    m = TorchModel(TwoHeads(), _sgd, {"digit": ce, "size": mse}, target_dtype={"digit": "long", "size": "float32"})
    converted = m._targets({"digit": y["digit"].astype(np.uint8), "size": y["size"]})
    assert (converted["digit"].dtype, converted["size"].dtype) == (torch.long, torch.float32)
    assert set(m.train_on_batch(x, y, return_dict=True)) == {"loss", "digit_loss", "size_loss", "digit_accuracy"}
    with pytest.raises(ValueError, match="per output, but the targets are one array"):
        m._targets(y["digit"])
    with pytest.raises(ValueError, match="not a torch dtype"):
        TorchModel(TwoHeads(), _sgd, ce, target_dtype="int77")
    with pytest.raises(ValueError, match=r"loss is given for target 'size', but the targets are keys \['digit'\]"):
        m.train_on_batch(x, {"digit": y["digit"]})
    # A regression: no accuracy (its default metric is not defined there), evaluate gives the loss alone.
    reg = TorchModel(torch.nn.Linear(15, 1), _sgd, torch.nn.MSELoss(), target_dtype="float32")
    features = np.concatenate([x["image"], x["extra"]], axis=1)
    assert list(reg.train_on_batch(features, y["size"][:, None], return_dict=True)) == ["loss"]
    assert isinstance(reg.evaluate(features, y["size"][:, None]), float)
    # Sequence labels (a class per position): the share of positions right, in [0, 1].
    seq = TorchModel(torch.nn.Linear(4, 3), _sgd, lambda o, t: ce(o.reshape(-1, 3), t.reshape(-1)))
    logs = seq.train_on_batch(np.ones((8, 5, 4), np.float32), np.zeros((8, 5), np.int64), return_dict=True)
    assert 0.0 <= logs["accuracy"] <= 1.0 and logs["accuracy"] in (0.0, 1.0)  # the same input at every position


class TwoHeadsApp(ddlf.IApp):
    """Rows of 15 features and 2 targets; preprocess hands the model named inputs and named targets (until the
    data plane carries dicts itself)."""

    dataset_key = "torch-two-heads"
    by_position = False

    def load_dataset(self):
        x, y = _two_heads_data(600, seed=3)
        return np.concatenate([x["image"], x["extra"]], axis=1), np.stack([y["digit"], y["size"]], axis=1)

    def preprocess(self, x, y):
        if self.by_position:
            return (x[:, :12], x[:, 12:]), (y[:, 0].astype(np.int64), y[:, 1])
        return {"image": x[:, :12], "extra": x[:, 12:]}, {"digit": y[:, 0].astype(np.int64), "size": y[:, 1]}

    def create_model(self):
        ce, mse = torch.nn.CrossEntropyLoss(), torch.nn.MSELoss()
        if self.by_position:
            return TorchModel(ByPosition(), _sgd, [ce, mse], loss_weights=[1.0, 0.5])
        return TorchModel(TwoHeads(), lambda p: torch.optim.Adam(p, lr=1e-2), {"digit": ce, "size": mse})


def test_named_inputs_and_two_outputs_train_on_a_cluster(cluster: ddlf.Cluster) -> None:
    app = TwoHeadsApp(cluster)
    validation = app.load_dataset()
    h = app.train(epochs=3, batch_size=16, verbose=0, validation_data=validation, strategy=ddlf.ModelAveraging(every=5))
    per_output = ["loss", "digit_loss", "size_loss", "digit_accuracy"]
    assert set(h.history) >= {*per_output, *(f"val_{k}" for k in per_output)}
    assert not any("size_accuracy" in k for k in h.history)
    assert h.history["size_loss"][-1] < h.history["size_loss"][0]
    assert h.history["val_digit_accuracy"][-1] > 0.8
    assert app.evaluate(*validation, return_dict=True)["digit_accuracy"] == h.history["val_digit_accuracy"][-1]


@pytest.mark.slow
def test_tuples_with_a_loss_per_output_average_gradients_as_one_process() -> None:
    from .apps import global_batches

    with pooled(2) as c:
        app = TwoHeadsApp(c)
        app.by_position = True
        app.model = app.create_model()
        start = app.model.get_weights()
        h = app.train(epochs=2, batch_size=16, verbose=0, strategy=ddlf.GradientAveraging(), run=ddlf.RunConfig(seed=4))
        assert "output_1_loss" in h.history and "output_1_accuracy" not in h.history
        x, y = app.load_dataset()
        ref = app.create_model()
        ref.set_weights(start)
        for rows in global_batches(2, 16, 2, 4, None):
            ref.train_on_batch(*app.preprocess(x[rows], y[rows]))
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(app.model.get_weights(), ref.get_weights()))
        assert diff < 2e-5, diff
        assert max(float(np.max(np.abs(a - b))) for a, b in zip(app.model.get_weights(), start)) > 100 * diff


# -- sharded optimizer state (GradientAveraging(shard_optimizer=True)) with a TorchModel ------------------------


def _small(optimizer) -> TorchModel:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    return TorchModel(module, optimizer, torch.nn.MSELoss(), metrics=())


_TORCH_OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
}


@pytest.mark.parametrize("name", sorted(_TORCH_OPTIMIZERS))
def test_a_torch_optimizer_on_a_flat_shard_takes_its_own_steps(name: str) -> None:
    """No daemons: on a ring of one the shard is the whole model, and three steps of the shard optimizer (then
    its state carried into a new one, as a ring change does, and two more) are torch's own five steps."""
    from ddlf.training.replica.sharded import ShardedOptimizer

    make = _TORCH_OPTIMIZERS[name]
    sharded_model, own = _small(make), _small(make)
    params = [p for p in own.module.parameters()]
    start = [p.detach().numpy().copy() for p in sharded_model.module.parameters()]
    shard = ShardedOptimizer(sharded_model)
    shard.begin(OneRank(), "fresh", False, None, start)
    # torch makes an optimizer's state at its first step (Adagrad's at its construction): the shard's too
    assert (shard.held() is None) == (not own.optimizer.state)
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal(w.shape).astype(np.float32) for w in start] for _ in range(5)]
    for g in grads[:3]:
        assert shard.step(g, 1.0, OneRank(), None) == "step"
    held = shard.held()
    assert held is not None and held.slots and held.stop == shard.length == 5 * 4 + 4 + 4 + 1
    # A new rank takes the whole state over (a checkpoint resumed, a ring that changed).
    moved = ShardedOptimizer(sharded_model)
    moved.begin(OneRank(), "reshard", True, held, [v.copy() for v in shard.weight_views])
    assert moved.state_bytes() == shard.state_bytes() > 0
    for g in grads[3:]:
        moved.step(g, 1.0, OneRank(), None)
    for g in grads:
        for p, a in zip(params, g):
            p.grad = torch.from_numpy(a)
        own.optimizer.step()
    for view, p in zip(moved.weight_views, params):
        np.testing.assert_allclose(view, p.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert not sharded_model.optimizer.state  # the model's own optimizer holds no state


def test_the_shard_optimizer_follows_the_models_learning_rate_and_betas() -> None:
    """A scheduler (or the linear scaling rule) changes the model's optimizer's parameter group: the shard's
    optimizer steps with the changed values."""
    from ddlf.training.replica.sharded import ShardedOptimizer

    make = _TORCH_OPTIMIZERS["Adam"]
    sharded_model, own = _small(make), _small(make)
    start = [p.detach().numpy().copy() for p in sharded_model.module.parameters()]
    shard = ShardedOptimizer(sharded_model)
    shard.begin(OneRank(), "fresh", False, None, start)
    scheduled = torch.optim.lr_scheduler.OneCycleLR(sharded_model.optimizer, max_lr=0.1, total_steps=10)
    reference = torch.optim.lr_scheduler.OneCycleLR(own.optimizer, max_lr=0.1, total_steps=10)
    rng = np.random.default_rng(1)
    for _ in range(4):
        g = [rng.standard_normal(w.shape).astype(np.float32) for w in start]
        shard.step(g, 1.0, OneRank(), None)
        for p, a in zip(own.module.parameters(), g):
            p.grad = torch.from_numpy(a)
        own.optimizer.step()
        with warnings.catch_warnings():  # the model's optimizer never steps on a worker that shards its state
            warnings.simplefilter("ignore", UserWarning)
            scheduled.step()
        reference.step()
    assert own.optimizer.param_groups[0]["betas"][0] < 0.9  # the schedule moved them, and the shard followed
    # (it takes them as each step begins: the values of the schedule's step before the last)
    assert shard.local.optimizer.param_groups[0]["betas"][0] < 0.9
    for view, p in zip(shard.weight_views, own.module.parameters()):
        np.testing.assert_allclose(view, p.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_redo_of_a_torch_optimizers_first_round_starts_fresh_and_loses_nothing() -> None:
    """torch makes the state at the first step: a round redone before any had ended had none to lose (no
    'optimizer state lost' warning), and the redone round starts from a fresh optimizer, not the part-way one."""
    from ddlf.training.replica.sharded import ShardedOptimizer

    model = _small(_TORCH_OPTIMIZERS["Adam"])
    start = [p.detach().numpy().copy() for p in model.module.parameters()]
    shard = ShardedOptimizer(model)
    assert shard.begin(OneRank(), "fresh", False, None, start) == 0
    shard.step([np.ones(w.shape, np.float32) for w in start], 1.0, OneRank(), None)  # part-way: then it failed
    assert shard.held() is not None
    assert shard.begin(OneRank(), "redo", False, None, start) == 0
    assert shard.held() is None  # fresh again
    np.testing.assert_array_equal(shard.weight_views[0], start[0])


class TorchAdamLinear(TorchLinear):
    dataset_key = "torch-sharded-linear"

    def create_model(self):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        return TorchModel(
            module, lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01), torch.nn.CrossEntropyLoss()
        )


def _one_torch_process(app: ddlf.IApp, start: list[np.ndarray], batches: list[np.ndarray]) -> list[np.ndarray]:
    x, y = app.load_dataset()
    ref = app.create_model()
    ref.set_weights(start)
    for rows in batches:
        ref.train_on_batch(x[rows], y[rows])
    return ref.get_weights()


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_torch_model_with_sharded_adamw_equals_one_process_with_identical_replicas(n: int) -> None:
    from .apps import global_batches, train_replicated

    strategy = ddlf.GradientAveraging(shard_optimizer=True)
    app, start, got, h, held = train_replicated(TorchAdamLinear, n, strategy)
    assert h.params["shard_optimizer"] is True
    want = _one_torch_process(app, start, global_batches(n, 16, 2, 4, None))
    diff = _max_diff(got, want)
    assert diff < 5e-5, diff
    assert _max_diff(got, start) > 100 * diff
    assert len(held.held) == n and held.identical()
    # Each worker held about 1/n of AdamW's two moments (12*16 + 16 + 16*2 + 2 = 242 weights).
    per_worker = [s.optimizer_state_bytes for s in h.stats if s.epoch == 1]
    assert sum(per_worker) == 2 * 242 * 4, per_worker
    assert max(per_worker) <= -(-242 // n) * 2 * 4


@pytest.mark.slow
def test_a_sharded_torch_checkpoint_resumes_on_another_number_of_workers(tmp_path) -> None:
    """One epoch on 3 workers, the second resumed on 2 from the checkpoint's joined state: one process's descent
    over both epochs, AdamW's moments and step count carried across."""
    from .apps import global_batches

    strategy = ddlf.GradientAveraging(shard_optimizer=True)
    with pooled(3) as c:
        app = TorchAdamLinear(c)
        app.model = app.create_model()
        start = app.model.get_weights()
        app.train(1, 16, verbose=0, strategy=strategy, run=ddlf.RunConfig(seed=4, checkpoint_dir=str(tmp_path)))
        resume = ddlf.RunConfig(seed=4, checkpoint_dir=str(tmp_path), resume=True, workers=[0, 1])
        h = app.train(2, 16, verbose=0, strategy=strategy, run=resume)
        got = app.model.get_weights()
    assert any(e["event"] == "resumed" for e in h.events)
    first = global_batches(3, 16, 1, 4, None)
    second = global_batches(2, 16, 2, 4, None)[len(global_batches(2, 16, 1, 4, None)) :]
    want = _one_torch_process(app, start, first + second)
    diff = _max_diff(got, want)
    assert diff < 5e-5, diff
    restarted = _one_torch_process(app, _one_torch_process(app, start, first), second)
    assert _max_diff(restarted, want) > 20 * diff  # the moments restarted from zeros would not pass


class TorchTwoGroups(TorchLinear):
    dataset_key = "torch-two-groups"

    def create_model(self):
        torch.manual_seed(0)
        first, second = torch.nn.Linear(12, 16), torch.nn.Linear(16, 2)
        module = torch.nn.Sequential(first, torch.nn.Tanh(), second)

        def optimizer(_):
            groups = [{"params": first.parameters(), "lr": 0.01}, {"params": second.parameters(), "lr": 0.001}]
            return torch.optim.Adam(groups)

        return TorchModel(module, optimizer, torch.nn.CrossEntropyLoss())


class TorchLbfgs(TorchLinear):
    dataset_key = "torch-lbfgs"

    def create_model(self):
        model = super().create_model()
        model.optimizer = torch.optim.LBFGS(model.module.parameters())
        return model


class TorchHeadOnly(TorchLinear):
    """The optimizer trains the last layer only, the first still requiring a gradient (unsharded, it stays put)."""

    dataset_key = "torch-head-only"

    def create_model(self):
        model = super().create_model()
        model.optimizer = torch.optim.Adam(model.module[2].parameters(), lr=0.01)
        return model


@pytest.mark.parametrize(
    ("app_class", "reason"),
    [
        (TorchTwoGroups, "2 parameter groups"),
        (TorchLbfgs, "LBFGS"),
        (TorchHeadOnly, "the optimizer trains 2 parameters and the module has 4"),
    ],
)
def test_a_torch_optimizer_that_cannot_be_sharded_is_refused_before_training(cluster, app_class, reason) -> None:
    app = app_class(cluster)
    with pytest.raises(ValueError, match=reason):
        app.train(1, 16, verbose=0, strategy=ddlf.GradientAveraging(shard_optimizer=True))
    if app_class is TorchTwoGroups:  # unsharded, the same model trains on the same workers
        h = app.train(1, 16, verbose=0, strategy=ddlf.GradientAveraging())
        assert len(h.history["loss"]) == 1
