#!/usr/bin/env bash
# Install (scripts/install.sh), then train the paper's CNN on MNIST with a local 2-worker cluster
# (synchronous parameter averaging) and print the test accuracy. Runs offline: MNIST ships in examples/data.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python examples/mnist_sync.py "$@"
