#!/usr/bin/env bash
# Install (scripts/install.sh), then run the whole test suite: lints, Rust unit and loopback tests, and the
# pytest end-to-end tests with real worker daemons.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

scripts/install.sh
scripts/install-system.sh

echo "== lint"
cargo fmt --all -- --check
.venv/bin/ruff check python tests examples
.venv/bin/ruff format --check python tests examples

echo "== cargo test"
# ddlf-py is the extension module (linked against the interpreter at import time): it is exercised by pytest.
cargo test --workspace --exclude ddlf-py

echo "== pytest"
.venv/bin/python -m pytest tests "$@"
