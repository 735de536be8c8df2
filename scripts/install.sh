#!/usr/bin/env bash
# Install everything ddlf needs into ./.venv, from nothing but Python 3.10+ and a Rust toolchain:
# the Python dependencies (numpy, cloudpickle, Keras with TensorFlow (CPU) and JAX, test tools, the docs site's
# mkdocs) and ddlf itself, built from source in release mode. protoc comes with the build (the protoc-bin-vendored
# crate); no system package needed. Keras runs on TensorFlow by default: the fastest backend on CPU for the paper's
# CNN (BENCHMARKS.md, "Keras backends on CPU"); JAX stays installed (the test suite and users who choose
# KERAS_BACKEND=jax).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "install.sh: a Rust toolchain (cargo) is required: https://rustup.rs" >&2
    exit 1
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet \
  "maturin>=1.5,<2" "numpy>=1.24" "cloudpickle>=3.0" "keras>=3.0" "tensorflow-cpu>=2.16" "jax>=0.4" \
  "pytest>=7" "pytest-timeout>=2" "pytest-xdist>=3.5" "ruff>=0.4" "mypy>=1.10" "pillow>=10" "tensorboardX>=2.6" "tensorboard>=2.14" "kubernetes-validate>=1.28" "pyyaml>=6" \
  "fsspec>=2023.1" "s3fs>=2023.1" "moto[server]>=5" "hypothesis>=6.100" "pyarrow>=15" \
  "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" "mkdocstrings[python]>=0.29"
# Build the Rust extension (release) and install the package in editable mode.
VIRTUAL_ENV="$PWD/.venv" .venv/bin/maturin develop --release --quiet
# The editable package's bytecode, written now: where PYTHONDONTWRITEBYTECODE is set (some CI images and sandboxes),
# Python never caches it, and every process (each worker daemon) compiles ddlf's modules again, 0.1-0.2 CPU-seconds
# each. A source edited later is compiled afresh (Python checks the cached file against the source).
.venv/bin/python -m compileall -q python/ddlf >/dev/null
.venv/bin/python -c "import ddlf; print('ddlf', ddlf.__version__, 'installed in .venv')"
