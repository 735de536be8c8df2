"""What TensorFlow keeps of each traced training step after the model is gone, and letting it go.

Every graph-mode call of a ``tf.custom_gradient`` function registers its gradient under a new name
(``CustomGradient-<uid>``) in TensorFlow's process-wide gradient registry, and nothing ever removes it. The
registered function's closure holds the traced graph, so each trace of a training step keeps its whole
``FuncGraph`` (operations, tensors, shapes) alive after the model, its ``tf.function`` and Keras' session are
dropped: ``keras.utils.clear_session()`` does not reach it. Keras on TensorFlow calls one per trace of
``train_step`` (the optimizer's gradient all-reduce through ``tf.distribute``'s default replica context), so a
long-lived worker that builds and traces a new model for each run grows by about 2.5 MiB per run for a small
MLP (``python -m benchmarks soak``; RELIABILITY.md).

A registration is read while the graph that made it is differentiated, which for Keras' step happens inside the
same trace. A worker forgets the registrations made during its training runs once none is left running (the
last run torn down, or ``Cluster.reset``), and every one on reset. Nothing here imports TensorFlow: a process that
has not loaded it has nothing to forget.
"""

from __future__ import annotations

import sys

PREFIX = "CustomGradient-"
"""The names ``tf.custom_gradient`` registers its graph-mode gradients under."""


def _registry() -> dict[str, object] | None:
    """TensorFlow's gradient registry (name -> entry), when TensorFlow is loaded and keeps it where it did."""
    ops = sys.modules.get("tensorflow.python.framework.ops")
    registry = getattr(getattr(ops, "_gradient_registry", None), "_registry", None)
    return registry if isinstance(registry, dict) else None


def custom_gradients() -> set[str]:
    """The custom gradients registered so far (empty when TensorFlow is not loaded)."""
    registry = _registry()
    return {name for name in registry if name.startswith(PREFIX)} if registry is not None else set()


def forget_custom_gradients(keep: set[str] | None = None) -> int:
    """Remove the custom-gradient registrations not in ``keep`` (None: every one), and so the traced graphs they
    hold; how many were removed. Only for graphs no longer being traced or differentiated."""
    registry = _registry()
    if registry is None:
        return 0
    names = [n for n in list(registry) if n.startswith(PREFIX) and (keep is None or n not in keep)]
    for name in names:
        registry.pop(name, None)
    return len(names)
