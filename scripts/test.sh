#!/usr/bin/env bash
# Install (scripts/install.sh), then run the whole test suite: lints (rustfmt, clippy, ruff), type checks (the
# extension's stub against the built module, mypy over the package), Rust unit and loopback tests, the Python unit
# tests (no daemons, seconds), then the end-to-end tests with real worker daemons and the network-namespace tests.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
# Each section's header says how long the run has taken so far (CI's whole run should stay near 25 minutes).
section() { echo "== $1 (at $((SECONDS / 60))m$((SECONDS % 60))s)"; }

scripts/install.sh
scripts/install-system.sh
# PyTorch for the TorchModel tests. PyPI's only Linux wheel links CUDA's libraries (they must be present even to
# train on CPU): about 1 minute and 5 GB here, so it is installed for the tests only, not by install.sh.
# DDLF_TEST_TORCH=0 skips it (the torch tests then skip, visibly).
if [ "${DDLF_TEST_TORCH:-1}" != 0 ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet "torch>=2.1"
fi

# pyspark (with pandas, which its Arrow stages need) for the Spark supplier tests (tests/e2e/test_spark.py): about
# 45 s and 500 MB here, for the tests only (`pip install pyspark` where ddlf.spark is used). Java comes from
# install-system.sh. DDLF_TEST_SPARK=0 skips it (the Spark tests then skip, visibly).
if [ "${DDLF_TEST_SPARK:-1}" != 0 ] && ! .venv/bin/python -c "import pyspark, pandas" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet "pyspark>=3.5" "pandas>=2.2,<3"
fi

PY_SOURCES=(python tests examples benchmarks scripts)

section "lint"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
.venv/bin/ruff check "${PY_SOURCES[@]}"
.venv/bin/ruff format --check "${PY_SOURCES[@]}"

section "types"
# The hand-written stub of the Rust extension must match the module that was built.
.venv/bin/python -m mypy.stubtest ddlf._ddlf --allowlist python/stubtest-allowlist.txt
.venv/bin/mypy python/ddlf

section "cargo test"
# ddlf-py is the extension module (linked against the interpreter at import time): it is exercised by pytest. The
# master's dispatch policy (ddlf_net::pool) and the workers' ring (ddlf_collective) have their loopback tests here.
cargo test --workspace --exclude ddlf-py

section "pytest: unit"
# Two processes: the unit tests are independent, and a few wait on subprocesses (valgrind, fresh interpreters).
.venv/bin/python -m pytest tests/unit -q -n 2

section "pytest: end to end, network namespaces and Slurm"
# Two test processes (pytest-xdist), each taking whole modules (a module's cluster starts once; the Slurm tests,
# one module, run one at a time): much of an end-to-end test is waiting (daemons starting, heartbeats, Slurm's
# scheduler), so two of them share the two cores well. DDLF_TEST_PROCESSES=0: one process.
.venv/bin/python -m pytest tests/e2e tests/netns tests/slurm -n "${DDLF_TEST_PROCESSES:-2}" --dist loadfile \
  --durations=15 "$@"
