"""The master's model is the truth of every ``train()``, for a ``TorchModel`` too: its optimizer's ``param_groups``
set by hand or by a torch scheduler (between runs and between epochs), and its parameters' ``requires_grad``,
are what the workers train with (:mod:`ddlf.frameworks.model_spec`). Its own module: its daemons load PyTorch
before anything loads TensorFlow (:mod:`ddlf.frameworks.loading`)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

import ddlf
from ddlf.training.callbacks import LambdaCallback

from .apps import flat, separable

BATCH = 32


def _train(app: ddlf.IApp, strategy: str, epochs: int = 1, **kw: Any) -> ddlf.History:
    strategies = {
        "model averaging": ddlf.ModelAveraging(every=4),
        "gradient averaging": ddlf.GradientAveraging(scale_learning_rate=False),
        "asynchronous": ddlf.Asynchronous(),
    }
    return app.train(
        epochs=epochs, batch_size=BATCH, strategy=strategies[strategy], run=ddlf.RunConfig(seed=3), verbose=0, **kw
    )


torch = pytest.importorskip("torch")


class TorchBinary(ddlf.IApp):
    dataset_key = "model-truth-binary"

    def load_dataset(self) -> Any:
        return separable()

    def create_model(self) -> Any:
        import torch

        from ddlf.models import TorchModel

        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        return TorchModel(net, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.nn.CrossEntropyLoss())


@pytest.mark.parametrize("strategy", ["model averaging", "gradient averaging", "asynchronous"])
def test_a_torch_rate_set_between_runs_reaches_the_workers(cluster: ddlf.Cluster, strategy: str) -> None:
    """``optimizer.param_groups[0]["lr"] = 0`` on the master's ``TorchModel`` between two runs: nothing moves."""
    app = TorchBinary(cluster)
    _train(app, strategy)
    start = flat(app.model.get_weights())
    for group in app.model.optimizer.param_groups:
        group["lr"] = 0.0
    history = _train(app, strategy)
    np.testing.assert_array_equal(start, flat(app.model.get_weights()))
    assert all("optimizer" in s["model_changes"] for s in history.params["setup"])


@pytest.mark.parametrize("strategy", ["model averaging", "gradient averaging", "asynchronous"])
def test_a_torch_scheduler_stepped_by_a_callback_reaches_the_workers(cluster: ddlf.Cluster, strategy: str) -> None:
    """A torch scheduler stepped at each epoch's end by a callback (``StepLR`` with ``gamma=0``: no rate after the
    first epoch): the second epoch trains nothing, as in a torch loop."""
    app = TorchBinary(cluster)
    app.model = app.create_model()
    scheduler = torch.optim.lr_scheduler.StepLR(app.model.optimizer, step_size=1, gamma=0.0)
    after: list[np.ndarray] = []

    def on_epoch_end(epoch: int, logs: Any = None) -> None:
        scheduler.step()
        after.append(flat(app.model.get_weights()))

    _train(app, strategy, epochs=3, callbacks=[LambdaCallback(on_epoch_end=on_epoch_end)])
    assert app.model.optimizer.param_groups[0]["lr"] == 0.0
    assert np.max(np.abs(after[0] - after[1])) == 0.0  # nothing trained after the rate went to 0
    np.testing.assert_array_equal(after[1], after[2])


def test_a_frozen_torch_parameter_stays_as_the_master_froze_it(cluster: ddlf.Cluster) -> None:
    """``requires_grad = False`` on a parameter of the master's module between runs: it does not move."""
    app = TorchBinary(cluster)
    _train(app, "gradient averaging")
    first = app.model.module[0]
    first.weight.requires_grad_(False)
    first.bias.requires_grad_(False)
    start = first.weight.detach().numpy().copy()
    others = app.model.module[2].weight.detach().numpy().copy()
    history = _train(app, "gradient averaging")
    np.testing.assert_array_equal(start, first.weight.detach().numpy())
    assert np.max(np.abs(others - app.model.module[2].weight.detach().numpy())) > 0
    assert all("requires_grad" in s["model_changes"] for s in history.params["setup"])


def _threads() -> int:
    import threading

    return threading.active_count()


def test_runs_one_after_another_leave_no_threads_behind(cluster: ddlf.Cluster) -> None:
    """Each gradient-averaging run of a ``TorchModel`` starts a thread for its gradient buckets: it ends with the
    run (the soak found one left per run)."""
    _train(TorchBinary(cluster), "gradient averaging")
    before = cluster.run(_threads)
    for _ in range(3):
        _train(TorchBinary(cluster), "gradient averaging")
    assert cluster.run(_threads) == before


class TorchAdamBinary(TorchBinary):
    def create_model(self) -> Any:
        import torch

        from ddlf.models import TorchModel

        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        return TorchModel(net, lambda p: torch.optim.Adam(p, lr=0.01), torch.nn.CrossEntropyLoss())


def _adam_steps(app: ddlf.IApp) -> float:
    """The master's Adam step count (the same for every parameter)."""
    steps = {float(s["step"]) for s in app.model.optimizer.state.values()}
    assert len(steps) == 1, steps
    return steps.pop()


@pytest.mark.parametrize("strategy", ["model averaging", "gradient averaging", "asynchronous"])
def test_a_second_train_goes_on_from_the_torch_optimizers_state(cluster: ddlf.Cluster, strategy: str) -> None:
    """As a second ``fit`` would: the master's ``TorchModel`` holds the run's Adam state when ``train`` ends (the
    workers' mean), and the next ``train`` starts every worker from it. The workers' optimizers started afresh
    each run before (Adam's step back at 0, its moments lost)."""
    app = TorchAdamBinary(cluster)
    _train(app, strategy, shuffle=False)
    first = _adam_steps(app)
    assert first > 0
    _train(app, strategy, epochs=2, initial_epoch=1, shuffle=False)
    assert _adam_steps(app) == pytest.approx(2 * first, abs=2)  # async workers differ by a few chunks
    if strategy == "gradient averaging":  # one state everywhere: two calls are one run of two epochs, exactly
        whole = TorchAdamBinary(cluster)
        _train(whole, strategy, epochs=2, shuffle=False)
        np.testing.assert_array_equal(flat(whole.model.get_weights()), flat(app.model.get_weights()))


def test_a_resumed_torch_run_goes_on_from_its_checkpointed_optimizer_state(cluster: ddlf.Cluster, tmp_path) -> None:
    """A run resumed from its checkpoint (a fresh model from ``create_model`` on every worker, its optimizer not
    stepped yet) adopts the checkpoint's Adam state and ends as the uninterrupted run does; it was dropped before."""
    whole = TorchAdamBinary(cluster)
    _train(whole, "gradient averaging", epochs=3, shuffle=False)
    app = TorchAdamBinary(cluster)
    run = ddlf.RunConfig(seed=3, checkpoint_dir=str(tmp_path))
    strategy = ddlf.GradientAveraging(scale_learning_rate=False)
    app.train(epochs=2, batch_size=BATCH, strategy=strategy, run=run, verbose=0, shuffle=False)
    again = TorchAdamBinary(cluster)
    resume = ddlf.RunConfig(seed=3, checkpoint_dir=str(tmp_path), resume=True)
    h = again.train(epochs=3, batch_size=BATCH, strategy=strategy, run=resume, verbose=0, shuffle=False)
    assert any(e["event"] == "resumed" for e in h.events)
    np.testing.assert_array_equal(flat(whole.model.get_weights()), flat(again.model.get_weights()))


class TorchAdamParts(TorchAdamBinary):
    """Its base frozen by ``create_model`` where ``frozen_base``."""

    frozen_base = False

    def create_model(self) -> Any:
        model = super().create_model()
        model.module[0].requires_grad_(not self.frozen_base)
        return model


def _steps(model: Any) -> list[int | None]:
    """Adam's step count of each parameter (None: it holds no state)."""
    state = model.optimizer.state
    return [int(state[p]["step"]) if p in state else None for p in model.module.parameters()]


@pytest.mark.parametrize("strategy", ["model averaging", "gradient averaging", "asynchronous"])
def test_what_the_user_replaces_on_a_torch_model_is_what_the_workers_train(cluster: ddlf.Cluster, strategy) -> None:
    """Between runs, as in a torch loop: a base frozen from the start holds no optimizer state and the head's goes
    on across runs (it was lost when any parameter held none); the head's state survives freezing; an optimizer
    over the head alone (fine-tuning) leaves the base where it is; a new ``loss_fn`` is the loss trained and
    reported; a module that prints otherwise (a ``Dropout``'s p) is warned of."""
    app = TorchAdamParts(cluster)
    app.frozen_base = True
    _train(app, strategy)
    first = _steps(app.model)
    assert first[:2] == [None, None] and first[2] is not None and first[2] > 0
    _train(app, strategy)
    assert _steps(app.model)[2:] == [2 * first[2]] * 2  # went on from the first run's state
    app = TorchAdamParts(cluster)
    _train(app, strategy)
    app.model.module[0].requires_grad_(False)  # frozen after training: its state is kept, as torch keeps it
    with warnings.catch_warnings():
        warnings.simplefilter("error", ddlf.OptimizerStateWarning)  # it fits: no "starts afresh"
        _train(app, strategy)
    steps = _steps(app.model)
    assert steps[2] == steps[3] == 2 * steps[0] and steps[0] == steps[1]
    base = [p.detach().clone() for p in app.model.module[0].parameters()]
    app.model.module[0].requires_grad_(True)  # trainable, but the new optimizer holds only the head
    app.model.optimizer = torch.optim.Adam(app.model.module[2].parameters(), lr=1e-2)
    history = _train(app, strategy)
    assert all(torch.equal(a, b) for a, b in zip(base, app.model.module[0].parameters()))
    assert history.history["loss"][0] < 1.0
    app.model.loss_fn = lambda out, target: 100.0 * torch.nn.functional.cross_entropy(out, target)
    history = _train(app, strategy)
    assert history.history["loss"][0] > 1.0  # the loss, a hundred times the small one it was


def test_a_torch_module_that_prints_otherwise_is_warned_of(cluster: ddlf.Cluster) -> None:
    app = TorchBinary(cluster)
    app.model = app.create_model()
    app.model.module[1] = torch.nn.Tanh()  # not create_model()'s ReLU: the workers cannot take it
    with pytest.warns(ddlf.ModelChangeWarning, match="prints otherwise than the master's"):
        history = _train(app, "gradient averaging")
    assert any(e["event"] == "model_mismatch" for e in history.events)


def test_a_worker_joining_a_torch_run_after_a_freeze_adopts_the_whole_state() -> None:
    """Gradient averaging on a ``TorchModel`` whose base was frozen after a first run: the members hold an Adam
    state for every parameter, a worker that joins primes only those that train. It takes the others' layout
    first, then their state (the all-reduce of states of two shapes failed), and every replica ends the same."""
    from ddlf.training.callbacks import Callback

    from ..conftest import POOL, pool_addresses
    from .test_model_truth import _replicas

    first, second, extra = pool_addresses(3, spare=True)
    held: list[list[np.ndarray]] = []

    class Add(Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if epoch == 0:
                cluster.add_worker(extra)
            else:
                held.extend(r for per in cluster.run(_replicas, self.history.params["run_id"]) for r in per)

    with ddlf.Cluster([first, second], token=POOL.token) as cluster:
        app = TorchAdamParts(cluster)
        _train(app, "gradient averaging")
        app.model.module[0].requires_grad_(False)
        history = _train(app, "gradient averaging", epochs=2, callbacks=[Add()])
    assert "added" in [e["event"] for e in history.events]
    steps = _steps(app.model)
    assert steps[0] == steps[1] and steps[2] == steps[3] > steps[0]  # the base's state kept, the head's gone on
    assert len(held) == 3
    for replica in held[1:]:
        for a, b in zip(held[0], replica):
            np.testing.assert_array_equal(a, b)
