"""A bounded run of every Rust kernel under valgrind's memcheck (``tests/valgrind/kernels.py``): an out-of-bounds
read or write in a kernel fails the suite even when it does not crash and its answer looks right. The harness's
own check runs first: a deliberate 64-byte over-read must be reported, so a valgrind that sees nothing cannot pass
for a clean run.

valgrind comes from Debian's package (``scripts/install-system.sh``); without it these tests skip outside CI and
fail inside it. Uninitialised-value checks are off (CPython and numpy's SIMD loops trip them harmlessly): what is
checked is every access outside an allocated block, which is what a kernel trusting a wrong length does. Two
false positives of the system's glibc (its dynamic loader, and an AVX2 string compare that reads whole vectors)
are suppressed by name and caller in ``tests/valgrind/system.supp``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1] / "valgrind"
ERROR_EXIT = 99


def _memcheck(script: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("valgrind") is None:
        if os.environ.get("CI"):
            pytest.fail("valgrind is not installed (scripts/install-system.sh installs it)")
        pytest.skip("valgrind is not installed")
    env = {**os.environ, "PYTHONMALLOC": "malloc", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run(
        [
            "valgrind",
            "--tool=memcheck",
            f"--error-exitcode={ERROR_EXIT}",
            "--undef-value-errors=no",
            "--leak-check=no",
            "--quiet",
            f"--suppressions={HERE / 'system.supp'}",
            sys.executable,
            str(HERE / script),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


def test_valgrind_sees_an_overread() -> None:
    done = _memcheck("overread.py")
    assert "overread: done" in done.stdout
    assert done.returncode == ERROR_EXIT, done.stderr[-3000:]
    assert "Invalid read" in done.stderr


def test_kernels_touch_only_their_buffers() -> None:
    done = _memcheck("kernels.py")
    assert "calls checked" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-5000:]
    assert "Invalid read" not in done.stderr and "Invalid write" not in done.stderr
