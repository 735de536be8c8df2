#!/usr/bin/env bash
# Install (scripts/install.sh), then run the whole test suite: lints (rustfmt, clippy, ruff), type checks (the
# extension's stub against the built module, mypy over the package), Rust unit and loopback tests, the Python unit
# tests (no daemons, seconds), then the end-to-end tests with real worker daemons and the network-namespace tests.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
# Each section's header says how long the run has taken so far (CI's whole run should stay under 20 minutes).
section() { echo "== $1 (at $((SECONDS / 60))m$((SECONDS % 60))s)"; }

scripts/install.sh
scripts/install-system.sh
# PyTorch for the TorchModel tests. PyPI's only Linux wheel links CUDA's libraries (they must be present even to
# train on CPU): about 1 minute and 5 GB here, so it is installed for the tests only, not by install.sh.
# DDLF_TEST_TORCH=0 skips it (the torch tests then skip, visibly).
if [ "${DDLF_TEST_TORCH:-1}" != 0 ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt 8 ]; then
    echo "scripts/test.sh: ${free_gb} GB free here; torch (with CUDA's libraries) needs about 5 GB and the Rust" \
      "test build about 3 GB more: pip may fail with 'No space left on device' (DDLF_TEST_TORCH=0 skips torch)" >&2
  fi
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

section "call-path guard"
# The rpc benchmark's ratios (a no-op call over a raw socket echo, in the same rounds), checked at a wide margin: a
# call path twice as slow fails here; noise does not (benchmarks/guard.py). Timings stay out of the tests.
.venv/bin/python -m benchmarks guard

section "pytest"
# The tests' own modules and the benchmarks' precompiled too (see install.sh): the suite starts hundreds of Python
# processes, daemons and scripts, that import them.
.venv/bin/python -m compileall -q tests benchmarks examples >/dev/null
# Two streams at once, so that the two cores stay busy while tests wait (daemons starting, heartbeats, Slurm's
# scheduler, emulated links). The side stream, one test at a time: the unit tests (no daemons), the model-truth cases
# again on JAX (a pytest process of its own), then the Slurm and network-namespace modules (they share one slurmctld
# and the host's namespaces). Beside it, the end-to-end tests in two test processes (pytest-xdist), each taking
# whole modules (a module's cluster starts once; these share one pool of daemons per process). The side stream's
# report follows the main one's. DDLF_TEST_PROCESSES=0: the main stream in one process. Arguments go to both streams
# (`-k`, `-x`, ...).
# (Moving the docs' examples beside as well made both streams longer: 13:10 and 12:35 in a fresh clone, against
# 11:57 for the whole stage this way; on two cores the pytest stages are CPU-bound at about 87% busy.)
SIDE=(tests/unit tests/e2e/test_model_truth_on_jax.py tests/slurm tests/netns)
MAIN=(tests/e2e --ignore=tests/e2e/test_model_truth_on_jax.py)
for arg in "$@"; do
  case "$arg" in
    -*) ;;
    *) if [ -e "${arg%%::*}" ]; then
         echo "scripts/test.sh passes pytest options to both streams, not tests to run (they would run twice):" \
           "for $arg run .venv/bin/python -m pytest $arg" >&2
         exit 2
       fi ;;
  esac
done
side_log=$(mktemp)
side_pid=
# A background command ignores Ctrl-C in a script: on Ctrl-C (once the main stream has stopped) or when this script
# stops early, the side stream is stopped with it.
stop_side() {
  if [ -n "$side_pid" ]; then kill -TERM "$side_pid" 2>/dev/null || true; fi
  rm -f "$side_log"
}
trap stop_side EXIT
trap 'stop_side; exit 130' INT TERM
.venv/bin/python -m pytest "${SIDE[@]}" -q --durations=5 "$@" >"$side_log" 2>&1 &
side_pid=$!
main_rc=0
if [ "${DDLF_TEST_PROCESSES:-2}" = 0 ]; then
  .venv/bin/python -m pytest "${MAIN[@]}" -q --durations=15 "$@" || main_rc=$?
else
  .venv/bin/python -m pytest "${MAIN[@]}" -q -n "${DDLF_TEST_PROCESSES:-2}" --dist loadfile --durations=15 \
    "$@" || main_rc=$?
fi
side_rc=0
wait "$side_pid" || side_rc=$?
side_pid=
section "pytest: unit, Slurm and network namespaces (run beside the end-to-end tests)"
cat "$side_log"
rm -f "$side_log"
# pytest exits 5 when it selects no test: fine for one stream (`-k` naming tests of the other), not for both.
if [ "$main_rc" = 5 ] && [ "$side_rc" = 5 ]; then exit 5; fi
for rc in "$main_rc" "$side_rc"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
section "done"
