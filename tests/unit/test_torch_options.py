"""TorchModel's device, precision, clipping, channels-last and compiled modules in one process (no daemons;
skipped without torch). The same options on a cluster: ``tests/e2e/test_torch_training_options.py``."""

from __future__ import annotations

import numpy as np
import pytest

import ddlf
from ddlf.frameworks import torch_placement
from ddlf.frameworks.torch_model import TorchModel

torch = pytest.importorskip("torch")


def _model(module=None, **options) -> TorchModel:
    torch.manual_seed(0)
    if module is None:
        module = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return TorchModel(module, lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.CrossEntropyLoss(), **options)


def _batch(rows: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 20)).astype(np.float32), rng.integers(0, 4, rows)


def test_the_device_auto_is_the_modules_else_the_gpu_else_the_cpu() -> None:
    cpu = torch.device("cpu")
    linear = torch.nn.Linear(2, 2)
    expected = torch.device("cuda") if torch.cuda.is_available() else cpu
    assert torch_placement.resolve_device(torch, "auto", linear) == expected
    assert torch_placement.resolve_device(torch, "cpu", linear) == cpu
    assert torch_placement.resolve_device(torch, cpu, linear) == cpu
    assert _model(device="cpu").device == cpu
    assert next(_model(device="cpu").module.parameters()).device == cpu


def test_the_device_auto_refuses_a_module_spread_over_devices() -> None:
    from types import SimpleNamespace

    class Spread:
        def parameters(self):
            return iter(
                [SimpleNamespace(device=torch.device("cuda:0")), SimpleNamespace(device=torch.device("cuda:1"))]
            )

    with pytest.raises(ddlf.ConfigError, match=r"on 2 devices \(\['cuda:0', 'cuda:1'\]\).*one device"):
        torch_placement.resolve_device(torch, "auto", Spread())


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda:7", r"device 'cuda:7' is not available in this process: torch sees \d+ CUDA device"),
        ("gpu please", r"device 'gpu please' is not a torch device"),
        (3.5, r"device 3.5 is not a torch device"),
    ],
)
def test_a_device_this_process_lacks_is_refused_with_what_to_do(device, message) -> None:
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    with pytest.raises(ddlf.ConfigError, match=message):
        _model(device=device)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"precision": "bf16-true"}, ddlf.ConfigError, r"precision must be one of \['32-true', 'bf16-mixed'"),
        ({"precision": "fp16"}, ddlf.ConfigError, "precision must be one of"),
        ({"clip_grad_norm": 0}, ddlf.ConfigError, "clip_grad_norm must be a positive number"),
        ({"clip_grad_norm": -1.0}, ddlf.ConfigError, "clip_grad_norm must be a positive number"),
        ({"clip_grad_norm": "1"}, ddlf.ConfigError, "clip_grad_norm must be a positive number"),
        ({"clip_grad_norm": True}, ddlf.ConfigError, "clip_grad_norm must be a positive number"),
        ({"channels_last": "yes"}, ddlf.ConfigTypeError, "channels_last must be True or False"),
    ],
)
def test_bad_options_are_refused_by_name(options, error, message) -> None:
    with pytest.raises(error, match=message):
        _model(**options)


def test_precision_and_clipping_can_be_set_later_and_are_checked_then_too() -> None:
    m = _model()
    assert m.precision == "32-true" and m.scaler is None and m.clip_grad_norm is None
    m.precision = "16-mixed"
    assert isinstance(m.scaler, torch.amp.GradScaler)
    m.precision = "bf16-mixed"
    assert m.scaler is None
    m.precision = "32"  # Lightning's short name
    assert m.precision == "32-true"
    m.clip_grad_norm = 2
    assert m.clip_grad_norm == 2.0
    with pytest.raises(ddlf.ConfigError):
        m.precision = "64-true"
    with pytest.raises(ddlf.ConfigError):
        m.clip_grad_norm = 0.0
    assert m.precision == "32-true" and m.clip_grad_norm == 2.0


def test_clipping_is_torchs_clip_grad_norm_before_the_step() -> None:
    x, y = _batch()
    clipped, plain = _model(clip_grad_norm=0.01), _model()
    start = plain.get_weights()
    plain.train_on_batch(x, y)
    clipped.train_on_batch(x, y)
    by_hand = _model()
    loss = torch.nn.functional.cross_entropy(by_hand.module(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(by_hand.module.parameters(), 0.01))
    by_hand.optimizer.step()
    assert norm > 0.1  # the clip bites
    for a, b in zip(clipped.get_weights(), by_hand.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    moved = np.sqrt(sum(float(np.sum((a - s) ** 2)) for a, s in zip(clipped.get_weights(), start)))
    assert moved == pytest.approx(0.1 * 0.01, rel=1e-3)  # one SGD step of lr 0.1 on gradients of norm 0.01
    assert any(np.abs(a - b).max() > 1e-4 for a, b in zip(plain.get_weights(), clipped.get_weights()))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_runs_the_forward_in_half_and_keeps_float32_weights(precision: str) -> None:
    half = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    seen = []
    m = _model(precision=precision)
    m.module[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    x, y = _batch()
    plain = _model()
    for _ in range(5):
        logs = m.train_on_batch(x, y, return_dict=True)
        plain.train_on_batch(x, y)
    assert seen == [half] * 5
    assert all(w.dtype == np.float32 for w in m.get_weights())
    for a, b in zip(m.get_weights(), plain.get_weights()):  # the same descent, to the half type's rounding
        np.testing.assert_allclose(a, b, atol=2e-2 if precision == "bf16-mixed" else 2e-3)
    assert logs["loss"] > 0
    out = m.predict(x)
    assert out.dtype == np.float32 and out.shape == (32, 4)  # numpy has no bfloat16: float32 out
    loss, acc = m.evaluate(x, y)
    assert np.isfinite(loss) and 0 <= acc <= 1


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_step_that_raises_under_float16_leaves_the_model_trainable(clip: float | None) -> None:
    """GradScaler records that a step unscaled and stepped until update(): a step that raised between the two (an
    optimizer that fails once, Ctrl-C) must not make every later step on the model (a warm one) refused."""
    m = _model(precision="16-mixed", clip_grad_norm=clip)
    x, y = _batch()
    real_step, calls = m.optimizer.step, []

    def step_that_fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the optimizer failed")
        return real_step(*args, **kwargs)

    m.optimizer.step = step_that_fails_once
    start = m.get_weights()
    with pytest.raises(RuntimeError, match="the optimizer failed"):
        m.train_on_batch(x, y)
    # Was refused ("unscale_() has already been called ...") with clipping, and without it stepped on the gradients
    # still scaled by 65536: now the step is the one a fresh model takes on the batch.
    m.train_on_batch(x, y)
    fresh = _model(precision="16-mixed", clip_grad_norm=clip)
    fresh.train_on_batch(x, y)
    assert len(calls) == 2 and m.scaler.get_scale() == fresh.scaler.get_scale() == 2.0**16
    assert any(np.abs(a - b).max() > 0 for a, b in zip(m.get_weights(), start))
    for a, b in zip(m.get_weights(), fresh.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_float16_overflow_skips_the_step_and_halves_the_scale() -> None:
    m = _model(precision="16-mixed")
    x, y = _batch()
    start = m.get_weights()
    bad = x.copy()
    bad[0] = 1e5  # float16 tops out at 65504
    m.train_on_batch(bad, y)
    assert m.scaler.get_scale() == 2.0**15
    for a, b in zip(m.get_weights(), start):
        np.testing.assert_array_equal(a, b)  # skipped
    m.train_on_batch(x, y)
    assert any(np.abs(a - b).max() > 0 for a, b in zip(m.get_weights(), start))


def test_a_compiled_module_trains_as_the_module_and_saves_plain_keys(tmp_path) -> None:
    x, y = _batch()
    plain = _model()
    compiled = _model(torch.compile(_model().module, backend="aot_eager"))
    compiled.set_weights(plain.get_weights())
    for _ in range(3):
        plain.train_on_batch(x, y)
        compiled.train_on_batch(x, y)
    for a, b in zip(plain.get_weights(), compiled.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert "compiled Sequential" in repr(compiled)
    path = str(tmp_path / "m.pt")
    compiled.save(path)
    assert list(torch.load(path, weights_only=True)) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    again = _model()
    again.load_weights(path)  # a module built without torch.compile loads it
    for a, b in zip(again.get_weights(), compiled.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_compiled_modules_dict_inputs_go_as_its_own_forward_takes_them() -> None:
    class ByName(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 2), torch.nn.Linear(4, 2)

        def forward(self, image, text):
            return self.a(image) + self.b(text)

    class WholeDict(ByName):
        def forward(self, batch):  # the compiled wrapper's forward takes **kwargs: its own must decide
            return self.a(batch["image"]) + self.b(batch["text"])

    x = {"image": np.ones((5, 3), np.float32), "text": np.ones((5, 4), np.float32)}
    y = np.zeros(5, np.int64)
    for cls in (ByName, WholeDict):
        m = _model(torch.compile(cls(), backend="aot_eager"))
        assert np.isfinite(m.train_on_batch(x, y)).all()


def test_channels_last_trains_a_convolution_as_the_default_layout() -> None:
    def conv() -> torch.nn.Module:
        torch.manual_seed(1)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 4),
        )

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 3, 12, 12)).astype(np.float32), rng.integers(0, 4, 8)
    last, default = _model(conv(), channels_last=True), _model(conv())
    assert last.module[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert last._batch(x).is_contiguous(memory_format=torch.channels_last)
    for _ in range(3):
        last.train_on_batch(x, y)
        default.train_on_batch(x, y)
    for a, b in zip(last.get_weights(), default.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_an_optimizer_built_before_the_module_moved_keeps_its_parameters() -> None:
    module = torch.nn.Linear(20, 4)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    m = TorchModel(module, optimizer, torch.nn.CrossEntropyLoss(), device="cpu")
    x, y = _batch()
    before = m.get_weights()
    m.train_on_batch(x, y)
    assert any(np.abs(a - b).max() > 0 for a, b in zip(m.get_weights(), before))
    assert {id(p) for p in module.parameters()} == {id(p) for g in optimizer.param_groups for p in g["params"]}


def test_the_training_options_travel_with_the_masters_model_but_not_its_device() -> None:
    from ddlf.frameworks import model_spec

    master = _model(precision="bf16-mixed", clip_grad_norm=1.5)
    spec = model_spec.describe(master)
    assert spec.training_options == {"precision": "bf16-mixed", "clip_grad_norm": 1.5}
    worker = _model()
    assert set(model_spec.apply(worker, spec)) == {"precision", "clip_grad_norm"}
    assert worker.precision == "bf16-mixed" and worker.clip_grad_norm == 1.5
    assert model_spec.apply(worker, spec) == []  # agrees now: nothing changes
    before = model_spec.signature(master)
    master.clip_grad_norm = None
    assert model_spec.changed(before, model_spec.signature(master)) == ["training_options"]


def test_the_gradient_scalers_state_travels_with_the_optimizers() -> None:
    """Replicas that average scaled gradients must share one scale: a worker joining (or a round redone) takes it
    with the optimizer state, as checkpoints keep it."""

    def adam(**options) -> TorchModel:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        return TorchModel(net, lambda p: torch.optim.Adam(p, lr=1e-3), torch.nn.CrossEntropyLoss(), **options)

    x, y = _batch()
    bad = x.copy()
    bad[0] = 1e5
    shrunk = adam(precision="16-mixed")
    shrunk.train_on_batch(x, y)
    shrunk.train_on_batch(bad, y)  # overflow: skipped, the scale halves
    state = shrunk.get_optimizer_state()
    assert [float(a) for a in state[-2:]] == [2.0**15, 0.0]
    fresh = adam(precision="16-mixed")
    fresh.train_on_batch(x, y)
    assert fresh.scaler.get_scale() == 2.0**16
    assert fresh.set_optimizer_state(state)
    assert fresh.scaler.get_scale() == 2.0**15
    plain = adam()
    plain.train_on_batch(x, y)
    assert len(plain.get_optimizer_state()) == len(state) - 2  # float32: the optimizer's own state only


def test_a_replica_without_a_batch_on_its_first_step_steps_with_the_others_average() -> None:
    """Gradient averaging: a worker with no rows for a step adds zeros and then applies the average like the others;
    under "16-mixed" its scaler has never scaled a loss, and must still unscale and step."""
    from ddlf.training.replica.steppers.torch_model import _TorchModelStepper

    m = _model(precision="16-mixed", clip_grad_norm=1.0)
    stepper = _TorchModelStepper(m)
    before = m.get_weights()
    averaged = [np.full(w.shape, 1024.0, np.float32) for w in stepper.zeros()]  # the others' scaled average
    stepper.apply(averaged)
    assert any(np.abs(a - b).max() > 0 for a, b in zip(m.get_weights(), before))
    assert m.scaler.get_scale() == 2.0**16
