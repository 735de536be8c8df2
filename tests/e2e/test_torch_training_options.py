"""TorchModel's device, mixed precision, compiled modules and gradient clipping on a cluster: each trained with
exact sync (gradient averaging) against one process on the same global batches (skipped without torch)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ddlf
from ddlf.frameworks.torch_model import TorchModel

from ..conftest import pooled
from .apps import global_batches

torch = pytest.importorskip("torch")

ROWS = 600


class TorchOptionsApp(ddlf.IApp):
    """A linear problem on 600 rows, its model built with the options of :attr:`options`."""

    dataset_key = "torch-options-linear"
    options: dict[str, Any] = {}
    compiled = False
    spike = False  # one row whose float16 forward overflows

    def load_dataset(self):
        rng = np.random.default_rng(7)
        x = rng.standard_normal((ROWS, 12)).astype(np.float32)
        y = (x @ rng.standard_normal(12) > 0).astype(np.int64)
        if self.spike:
            x[17] = 1e5  # float16 tops out at 65504: this row's forward is inf under "16-mixed"
        return x, y

    def create_model(self):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        if self.compiled:
            module = torch.compile(module, backend="aot_eager")  # dynamo and AOTAutograd, without a C++ build
        return TorchModel(module, lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.CrossEntropyLoss(), **self.options)


def _gap(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def _train_and_replay(app_class: type[TorchOptionsApp], on_master: dict[str, Any] | None = None):
    """Exact sync on 2 workers for 2 epochs of batch 16, and the same global batches in one process from the same
    start (``on_master``: options set on the master's model after ``create_model``, which the workers must
    follow). Returns the trained weights, the replayed ones, the start and the history."""
    with pooled(2) as c:
        app = app_class(c)
        app.model = app.create_model()
        for name, value in (on_master or {}).items():
            setattr(app.model, name, value)
        start = app.model.get_weights()
        h = app.train(epochs=2, batch_size=16, verbose=0, strategy=ddlf.GradientAveraging(), run=ddlf.RunConfig(seed=4))
        x, y = app.load_dataset()
        ref = app.create_model()
        for name, value in (on_master or {}).items():
            setattr(ref, name, value)
        ref.set_weights(start)
        for rows in global_batches(2, 16, 2, 4, None):
            ref.train_on_batch(x[rows], y[rows])
        return app.model.get_weights(), ref.get_weights(), start, h


class ExplicitCpu(TorchOptionsApp):
    dataset_key = "torch-options-linear"
    options = {"device": "cpu"}


class Bf16(TorchOptionsApp):
    options = {"precision": "bf16-mixed"}


class Fp16(TorchOptionsApp):
    options = {"precision": "16-mixed"}


class Clipped(TorchOptionsApp):
    options = {"clip_grad_norm": 0.3}


class Compiled(TorchOptionsApp):
    compiled = True


@pytest.mark.parametrize(
    ("app_class", "tolerance"),
    [
        (ExplicitCpu, 2e-5),
        (Clipped, 2e-5),
        (Compiled, 2e-5),
        # Under autocast each worker's gradient is rounded to the lower precision over its own half of the batch:
        # the same steps to within that rounding (bfloat16 keeps 8 bits, float16 11).
        (Bf16, 2e-2),
        (Fp16, 2e-3),
    ],
    ids=["device-cpu", "clip-grad-norm", "torch-compile", "bf16-mixed", "16-mixed"],
)
def test_each_option_averages_gradients_as_one_process(app_class: type[TorchOptionsApp], tolerance: float) -> None:
    trained, replayed, start, h = _train_and_replay(app_class)
    gap = _gap(trained, replayed)
    assert gap < tolerance, gap
    assert _gap(trained, start) > 20 * gap  # it trained: far more than the two differ
    assert h.history["accuracy"][-1] > 0.8
    assert "nonfinite_batches" not in h.history or not any(h.history["nonfinite_batches"])


def test_clipping_is_applied_to_the_averaged_gradients() -> None:
    """Clipped and unclipped runs differ (the clip bites at 0.3: the norms run 0.36-0.53), and the clipped one is
    one process's clipped descent: the workers clip the average, not each their own half (another step)."""
    clipped, replayed, _, _ = _train_and_replay(Clipped)
    plain, _, _, _ = _train_and_replay(TorchOptionsApp)
    assert _gap(clipped, plain) > 100 * _gap(clipped, replayed)


class Fp16Spike(TorchOptionsApp):
    dataset_key = "torch-options-spike"
    options = {"precision": "16-mixed"}
    spike = True


def test_a_float16_overflow_skips_the_step_on_every_worker_as_in_one_process() -> None:
    """A row whose float16 forward overflows: the worker holding it averages inf into the ring, so every worker's
    scaler skips that step and halves its scale, as one process does on the global batch; it is not left out as
    a non-finite batch (which would step on the other half)."""
    trained, replayed, start, h = _train_and_replay(Fp16Spike)
    assert all(np.isfinite(w).all() for w in trained)
    x, y = Fp16Spike.load_dataset(Fp16Spike.__new__(Fp16Spike))
    probe = Fp16Spike.create_model(Fp16Spike.__new__(Fp16Spike))
    probe.train_on_batch(x[16:20], y[16:20])  # the spike overflows: the step is skipped and the scale halves
    assert probe.scaler.get_scale() == 2.0**15
    assert _gap(trained, replayed) < 2e-3
    assert _gap(trained, start) > 0.1
    assert "nonfinite_batches" not in h.history or not any(h.history["nonfinite_batches"])


def test_options_set_on_the_masters_model_reach_the_workers() -> None:
    """``create_model`` builds no clipping and float32; the master's model is then set to clip and to bf16: the
    workers train as the master's model says, as one process with those settings."""
    trained, replayed, _, _ = _train_and_replay(
        TorchOptionsApp, on_master={"clip_grad_norm": 0.3, "precision": "bf16-mixed"}
    )
    plain, _, _, _ = _train_and_replay(TorchOptionsApp)
    gap = _gap(trained, replayed)
    assert gap < 2e-2
    assert _gap(trained, plain) > 5 * gap


def test_float16_with_sharded_optimizer_state_is_refused_and_the_cluster_keeps_serving() -> None:
    with pooled(2) as c:
        app = Fp16(c)
        with pytest.raises(ddlf.ConfigError, match=r"precision='16-mixed'.*gradient scaler.*bf16-mixed"):
            app.train(1, 16, verbose=0, strategy=ddlf.GradientAveraging(shard_optimizer=True))
        h = app.train(2, 16, verbose=0, strategy=ddlf.GradientAveraging())
        assert h.history["loss"][1] < h.history["loss"][0]
        bf16 = Bf16(c)  # bfloat16 needs no scaler: its shards train
        h = bf16.train(2, 16, verbose=0, strategy=ddlf.GradientAveraging(shard_optimizer=True))
        assert h.history["loss"][1] < h.history["loss"][0]


def test_a_device_this_worker_lacks_is_refused_by_name() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")

    class OnGpu(TorchOptionsApp):
        options = {"device": "cuda:0"}

    with pooled(2) as c:
        with pytest.raises(ddlf.ConfigError, match=r"device 'cuda:0' is not available.*device='auto'"):
            OnGpu(c).train(1, 16, verbose=0)
        assert len(ExplicitCpu(c).train(1, 16, verbose=0).history["loss"]) == 1
