"""``train()``'s typed options (``ddlf.training.options``): each object checks itself when made, combinations that
cannot work cannot be written, and ``TrainConfig`` resolves what the loops read. Pure logic, no daemons."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import ddlf
from ddlf.errors import ConfigError
from ddlf.training.options import TrainConfig
from ddlf.training.run import SLOW_WORKER_ENV, RunState


def test_defaults_are_the_papers_model_averaging_through_the_master() -> None:
    cfg = TrainConfig(epochs=2, batch_size=32)
    assert cfg.strategy == ddlf.ModelAveraging() and cfg.mode == "sync" and cfg.averaging == "weights"
    assert cfg.round_batches is None  # one round per epoch
    assert cfg.compression is None and cfg.outer() is None and not cfg.average_optimizer_state
    assert cfg.data == ddlf.DataConfig() and cfg.run == ddlf.RunConfig()
    assert cfg.learning_rate_factor(4, 0.5) == 1.0
    assert len(RunState().run_id) == 12 and RunState().run_id != RunState().run_id  # each run its own id


def test_each_strategy_resolves_to_what_the_loops_read() -> None:
    ma = TrainConfig(1, 8, strategy=ddlf.ModelAveraging(every=5, optimizer_state=True, outer=ddlf.Nesterov(0.5, 0.8)))
    assert (ma.round_batches, ma.average_optimizer_state, ma.mode) == (5, True, "sync")
    outer = ma.outer()
    assert outer is not None and (outer.name, outer.learning_rate, outer.momentum) == ("nesterov", 0.5, 0.8)

    ga = TrainConfig(1, 8, strategy=ddlf.GradientAveraging(check_in_every=3, ring=ddlf.Ring(compression="bfloat16")))
    assert (ga.averaging, ga.round_batches, ga.compression) == ("gradients", 3, "bfloat16")
    assert ga.ring == ddlf.Ring(compression="bfloat16")  # gradient averaging is always on its ring
    assert ga.outer() is None and not ga.average_optimizer_state

    asy = TrainConfig(1, 8, strategy=ddlf.Asynchronous(chunk=4, compression=ddlf.TopK(0.05)))
    assert (asy.mode, asy.round_batches, asy.compression, asy.topk_ratio) == ("async", 4, "topk", 0.05)
    assert asy.ring is None


def test_the_exchange_of_model_averaging_gives_its_compression() -> None:
    through = TrainConfig(1, 8, strategy=ddlf.ModelAveraging(exchange=ddlf.ThroughMaster(compression="float16")))
    assert through.compression == "float16" and through.ring is None
    # resolved by app.train for the cluster (AutoExchange picks one); until then the asked one is read
    through = dataclasses.replace(through, exchange=ddlf.Ring(compression="float16"))
    assert through.ring == ddlf.Ring(compression="float16")


def test_learning_rate_scaling_with_warm_up() -> None:
    cfg = TrainConfig(1, 8, strategy=ddlf.GradientAveraging(scale_learning_rate=True, warmup_epochs=2))
    assert cfg.scale_learning_rate
    assert cfg.learning_rate_factor(4, 0.0) == 1.0
    assert cfg.learning_rate_factor(4, 1.0) == pytest.approx(2.5)
    assert cfg.learning_rate_factor(4, 5.0) == 4.0  # reached, then held
    now = TrainConfig(1, 8, strategy=ddlf.GradientAveraging(scale_learning_rate=True))
    assert now.learning_rate_factor(3, 0.0) == 3.0


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: ddlf.ModelAveraging(every=0), ValueError, r"ModelAveraging\.every"),
        (lambda: ddlf.ModelAveraging(every=2.5), ValueError, r"ModelAveraging\.every"),
        (lambda: ddlf.ModelAveraging(optimizer_state="yes"), TypeError, "optimizer_state"),
        (lambda: ddlf.ModelAveraging(outer="nesterov"), TypeError, "outer"),
        (lambda: ddlf.ModelAveraging(exchange="allreduce"), TypeError, "exchange"),
        (lambda: ddlf.Nesterov(learning_rate=0), ValueError, r"Nesterov\.learning_rate"),
        (lambda: ddlf.Nesterov(momentum=1.0), ValueError, r"Nesterov\.momentum"),
        (lambda: ddlf.GradientAveraging(warmup_epochs=1), ValueError, "scale_learning_rate=True"),
        (lambda: ddlf.GradientAveraging(scale_learning_rate=1), TypeError, "scale_learning_rate"),
        (lambda: ddlf.GradientAveraging(shard_optimizer="yes"), TypeError, "shard_optimizer must be True or False"),
        (lambda: ddlf.GradientAveraging(bucket_cap_mb=-1), ValueError, "bucket_cap_mb"),
        (lambda: ddlf.GradientAveraging(bucket_cap_mb=float("inf")), ValueError, "bucket_cap_mb"),
        (lambda: ddlf.GradientAveraging(ring=ddlf.ThroughMaster()), TypeError, "ring"),
        (lambda: ddlf.Asynchronous(chunk=0), ValueError, r"Asynchronous\.chunk"),
        (lambda: ddlf.Asynchronous(max_staleness=-1), ValueError, "max_staleness"),
        (lambda: ddlf.Asynchronous(staleness="dynsgd"), TypeError, "staleness"),
        (lambda: ddlf.Asynchronous(compression="int8"), ValueError, "compression"),
        (lambda: ddlf.TopK(0), ValueError, r"TopK\.ratio"),
        (
            lambda: ddlf.TopK(1.5),
            ValueError,
            r"TopK\.ratio \(the share sent\) must be a finite number > 0\.0 and <= 1\.0, not 1\.5",
        ),
        (lambda: ddlf.TopK(float("nan")), ValueError, r"TopK\.ratio"),
        (lambda: ddlf.Ring(compression=ddlf.TopK()), ValueError, r"Ring\.compression"),
        (lambda: ddlf.Ring(hierarchical="yes"), ValueError, r"Ring\.hierarchical"),
        (lambda: ddlf.ThroughMaster(compression="float8"), ValueError, r"'bfloat16' or a ddlf\.TopK, not 'float8'"),
        (lambda: ddlf.Ring(compression="float8"), ValueError, r"None, 'float16' or 'bfloat16', not 'float8'"),
        (lambda: ddlf.DataConfig(send="seeded"), ValueError, r"DataConfig\.send"),
        (lambda: ddlf.DataConfig(worker_shares=(1.0, 0.0)), ValueError, "worker_shares"),
        (lambda: ddlf.DataConfig(rotate_shards_every=0), ValueError, "rotate_shards_every"),
        (lambda: ddlf.DataConfig(prefetch=-1), ValueError, "prefetch"),
        (lambda: ddlf.RunConfig(resume=True), ValueError, "checkpoint_dir"),
        (lambda: ddlf.RunConfig(workers=[]), ValueError, "empty"),
        (lambda: ddlf.RunConfig(workers="01"), TypeError, "worker indices"),
        (lambda: ddlf.RunConfig(workers=[-1]), IndexError, "out of range"),
        (lambda: ddlf.RunConfig(seed=1.5), TypeError, "seed"),
        (lambda: ddlf.RunConfig(nonfinite="ignore"), ValueError, "nonfinite"),
        (lambda: ddlf.RunConfig(rejoin_timeout=float("nan")), ValueError, "rejoin_timeout"),
        (lambda: ddlf.RunConfig(failure_policy="raise"), TypeError, "FailurePolicy"),
        (lambda: TrainConfig(1, 0), ValueError, "batch_size"),
        (lambda: TrainConfig(-1, 8), ValueError, "epochs"),
        (lambda: TrainConfig(np.zeros((4, 2)), np.zeros(4)), TypeError, r"train\(\) takes no data"),  # as fit(x, y)
        (lambda: TrainConfig(1, 8, strategy=ddlf.Ring()), TypeError, "strategy must be"),
        (lambda: TrainConfig(1, 8, data=ddlf.RunConfig()), TypeError, "data must be"),
    ],
)
def test_what_cannot_work_is_refused_when_made(make, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_options_are_frozen_values() -> None:
    run = ddlf.RunConfig(workers=[3, 1, 1], checkpoint_dir=__import__("pathlib").Path("ckpt"))
    assert run.workers == (1, 3) and run.checkpoint_dir == "ckpt"  # normalised once
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 2  # type: ignore[misc]
    assert ddlf.DataConfig(worker_shares=[3, 1]).worker_shares == (3.0, 1.0)
    assert ddlf.ModelAveraging(every=5) == ddlf.ModelAveraging(every=5)  # compare and hash as values
    assert len({ddlf.Ring(), ddlf.Ring(), ddlf.Ring(hierarchical=False)}) == 2


def test_the_slow_worker_hook_is_an_environment_variable_of_the_run_not_an_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert RunState().slow_worker is None
    monkeypatch.setenv(SLOW_WORKER_ENV, "1:0.02")
    assert RunState().slow_worker == (1, 0.02)
    assert (RunState().slow_seconds(1), RunState().slow_seconds(0)) == (0.02, 0.0)
    monkeypatch.setenv(SLOW_WORKER_ENV, "fast")
    with pytest.raises(ValueError, match="WORKER:SECONDS"):
        RunState()


def test_what_an_override_receives_is_frozen_and_holds_no_run_state() -> None:
    cfg = TrainConfig(2, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.epochs = 3  # type: ignore[misc]
    assert dataclasses.replace(cfg, epochs=3).epochs == 3  # a changed copy
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not fields & {"run_id", "t0", "slow_worker", "strategy_reason", "resumed"}, fields


def test_train_takes_fits_arguments_and_the_four_options() -> None:
    import inspect

    params = list(inspect.signature(ddlf.IApp.train).parameters)
    assert params[:3] == ["self", "epochs", "batch_size"]
    assert len(params) - 1 <= 14  # room for fit's remaining arguments, and no more
    assert {"strategy", "data", "run", "validation_data", "callbacks", "verbose", "initial_epoch"} <= set(params)
    assert not [p for p in params if p.startswith("_")]  # no test hooks in the public signature


def test_the_default_async_chunk_follows_the_worker_count() -> None:
    """Issue 37: the default chunk keeps a merged change about two of the other workers' steps stale (one worker:
    never stale, 10); a chunk the user sets wins."""
    a = ddlf.Asynchronous()
    assert a.chunk is None
    assert [a.chunk_batches(n) for n in (1, 2, 3, 4, 8)] == [10, 2, 1, 1, 1]
    assert ddlf.Asynchronous(chunk=7).chunk_batches(4) == 7


class _NoCluster:
    """Any use of the cluster fails the test: the argument check comes first."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the cluster was used ({name}) before the arguments were checked")


@pytest.mark.parametrize("batch_size", [0, -1, "32", 2.5, True, None])
@pytest.mark.parametrize("what", ["evaluate", "predict"])
def test_evaluate_and_predict_refuse_a_batch_size_that_is_not_a_positive_integer(what: str, batch_size: Any) -> None:
    """``evaluate(batch_size=-1)`` returned 0.0 and ``predict(batch_size=-1)`` an empty array; 0 gave a bare
    ``range()`` error or a ZeroDivisionError from a worker. Refused on the master now, before anything is sent."""

    class App(ddlf.IApp):
        def load_dataset(self) -> Any:
            raise AssertionError("not reached")

        def create_model(self) -> Any:
            raise AssertionError("not reached")

    app = App(_NoCluster())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=rf"{what}\(\)'s batch_size must be an integer >= 1"):
        getattr(app, what)(batch_size=batch_size)


def test_a_count_of_the_wrong_type_is_a_config_type_error_and_a_bad_count_a_config_error() -> None:
    """As the error contract says: ``every="5"`` is of the wrong type (``ConfigTypeError``, a ``TypeError`` too),
    ``every=0`` a value ddlf cannot use (``ConfigError``, a ``ValueError``, not a ``TypeError``)."""
    for wrong in ("5", 2.5, True):
        with pytest.raises(ddlf.ConfigTypeError, match="must be an integer >= 1"):
            ddlf.ModelAveraging(every=wrong)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be an integer >= 1") as info:
        ddlf.ModelAveraging(every=0)
    assert not isinstance(info.value, TypeError)
