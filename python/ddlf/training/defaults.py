"""The strategy ``app.train`` uses when it is given none, and why.

Chosen by measurement (issue 37; BENCHMARKS.md, *Time to accuracy*): a user compares ddlf with the one-process
``fit`` they ran before at the same ``batch_size``. After the same epochs, with ``n`` workers each at that batch
size, one round of model averaging per epoch (the DDLF paper's, ddlf's default until then) ended 1-9 points below
it; gradient averaging with the learning rate scaled by ``n`` (Goyal et al. 2017's linear scaling rule, as in
Horovod's examples) matched it on every task measured, and reached the target accuracy in less time. So without a
``strategy``:

- :class:`~ddlf.GradientAveraging` with ``scale_learning_rate=True`` on two or more workers;
- without the scaling when the optimizer follows a learning-rate schedule (its rate is the schedule's, for the
  user to scale): exactly one process at ``n`` times the batch;
- :class:`~ddlf.ModelAveraging` (one round per epoch) on one worker (nothing to average between steps: the
  worker trains as ``fit`` does), for a model with its own ``train_step`` (it may apply several optimizers, a GAN's
  two steps, or run on JAX where its gradients cannot be reached), and when resuming a checkpoint that another
  strategy wrote (its workers' optimizer states differ);
- gradient averaging, sharded and scaled as it was, when resuming a checkpoint gradient averaging wrote.

Every choice can be switched off by passing a strategy; ``history.params["strategy"]`` names the one used and
``history.params["strategy_reason"]`` why (``None`` when the user chose it).
"""

from __future__ import annotations

from typing import Any

from .options import GradientAveraging, ModelAveraging, Strategy


def default_strategy(model: Any, workers: int, saved: dict[str, Any] | None = None) -> tuple[Strategy, str]:
    """The strategy for ``model`` trained on ``workers`` workers without one given (``saved``: the checkpoint the
    run resumes, if any), and the reason, in words."""
    if saved is not None:
        written = saved.get("strategy")
        if written != "GradientAveraging":
            return ModelAveraging(), f"resuming a checkpoint written by {written or 'model averaging'}"
        states = [s for s in (saved.get("worker_states") or {}).values() if isinstance(s, dict)]
        sharded = any(s.get("optimizer_shard") is not None for s in states)
        scaled = saved.get("scale_learning_rate")  # None: written before checkpoints recorded it
        return (
            GradientAveraging(scale_learning_rate=scaled is not False and _scalable(model), shard_optimizer=sharded),
            "resuming a checkpoint written by gradient averaging",
        )
    if workers <= 1:
        return ModelAveraging(), "one worker: it trains as fit does, one round per epoch"
    from .replica.steppers import overrides_train_step

    if overrides_train_step(model):
        return ModelAveraging(), f"{type(model).__name__} has its own train_step"
    if not _scalable(model):
        return (
            GradientAveraging(),
            f"gradient averaging on {workers} workers; the learning-rate schedule is not scaled",
        )
    return (
        GradientAveraging(scale_learning_rate=True),
        f"gradient averaging on {workers} workers, learning rate x {workers}",
    )


def _scalable(model: Any) -> bool:
    from .replica.steppers import check_scalable

    try:
        check_scalable(model)
    except ValueError:
        return False
    return True
