"""The examples run as a user runs them: as scripts, on a fresh local cluster."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ..conftest import REPO


def _run(args: list[str], timeout: float = 600) -> str:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


@pytest.mark.slow
def test_cifar10_example_reads_the_binary_format(tmp_path) -> None:
    rng = np.random.default_rng(0)
    for name, n in [(f"data_batch_{i}.bin", 40) for i in range(1, 6)] + [("test_batch.bin", 50)]:
        labels = rng.integers(0, 10, (n, 1), dtype=np.uint8)
        pixels = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        np.concatenate([labels, pixels], axis=1).tofile(tmp_path / name)
    out = _run(["examples/cifar10_cnn.py", "--data", str(tmp_path), "--epochs", "1", "--batch-size", "16"])
    assert "Epoch 1/1" in out and "test accuracy:" in out


@pytest.mark.slow
def test_mnist_example_runs_one_quick_epoch() -> None:
    out = _run([os.path.join("examples", "mnist_sync.py"), "--epochs", "1", "--limit", "2000"])
    assert "test accuracy:" in out and "sync, 2 workers, 1 epochs" in out


@pytest.mark.slow
def test_the_transformer_example_learns_the_standard_librarys_bytes_with_exact_gradients() -> None:
    tiny = ["--mb", "0.06", "--context", "32", "--layers", "1", "--width", "32", "--heads", "2", "--batch-size", "8"]
    out = _run(["examples/char_transformer.py", "--strategy", "ga", *tiny, "--learning-rate", "3e-3"])
    assert "tokens/s" in out, out
    held = float(out.split("held-out loss:")[1].split("(")[1].split(" bits/byte")[0])
    assert held < 6.0, out  # below 8 bits per byte (uniform over bytes): it learned the text's statistics
