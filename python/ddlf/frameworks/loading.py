"""Two frameworks in one process: TensorFlow and PyTorch's compiler each carry their own copy of LLVM.

With ``triton`` installed (PyPI's Linux wheel of torch brings it), loading ``torch._dynamo`` (which every
``torch.optim`` optimizer does on first use) *after* TensorFlow aborts the process (``LLVM ERROR: inconsistency in
registered CommandLine options``); the other order works. ddlf loads PyTorch's compiler first where a run needs
it (a ``TorchModel`` or Keras on torch: ``training.common.set_random_seed``, the master telling its workers) and in a
daemon that preloads TensorFlow (a later run may bring a ``TorchModel``), and turns the abort into an error
everywhere else (``TorchModel``). Nowhere else: it costs 3.3 s and about 900 MB of mappings per process.
"""

from __future__ import annotations

import functools
import importlib.util
import sys


def installed(name: str) -> bool:
    """Whether top-level module ``name`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def clash_possible() -> bool:
    """Whether loading TensorFlow and PyTorch's compiler in one process depends on their order here (asked once:
    ddlf asks before every seeding)."""
    return installed("triton") and installed("torch") and installed("tensorflow")


def load_torch_compiler_first() -> None:
    """Before this process loads TensorFlow: load ``torch._dynamo`` first where the order matters."""
    if "tensorflow" not in sys.modules and "torch._dynamo" not in sys.modules and clash_possible():
        import torch._dynamo  # noqa: F401


def check_torch_compiler_can_load() -> None:
    """Before PyTorch's compiler loads: refuse, with the fix, where it would abort the process."""
    if "tensorflow" in sys.modules and "torch._dynamo" not in sys.modules and installed("triton"):
        raise RuntimeError(
            "TensorFlow is loaded in this process and PyTorch's compiler (torch._dynamo, loaded by every torch "
            "optimizer) is not: with triton installed, loading it now would abort the process (two copies of "
            "LLVM). Load PyTorch first (`import torch._dynamo` before anything imports tensorflow or keras), or run "
            "Keras on another backend (KERAS_BACKEND=jax); on a worker daemon, start it with --preload torch,keras"
        )
