"""``python -m benchmarks NAME``: run a benchmark and record it in BENCHMARKS.md."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "rpc": "benchmarks.rpc",
    "guard": "benchmarks.guard",
    "tensor": "benchmarks.tensor",
    "data": "benchmarks.data",
    "train": "benchmarks.train",
    "faults": "benchmarks.faults",
    "network": "benchmarks.network",
    "project": "benchmarks.project",
    "elephas": "benchmarks.vs_elephas",
    "ab": "benchmarks.ab",
    "collective": "benchmarks.collective",
    "serialization": "benchmarks.serialization",
    "backends": "benchmarks.backends",
    "warmstart": "benchmarks.warmstart",
    "sweep": "benchmarks.sweep",
    "gpu": "benchmarks.gpu",
    "scaling": "benchmarks.scaling",
    "averaging": "benchmarks.averaging",
    "accuracy": "benchmarks.accuracy",
    "exchange": "benchmarks.exchange",
    "exactsync": "benchmarks.exactsync",
    "lm": "benchmarks.lm",
    "zero": "benchmarks.zero",
    "chaos": "benchmarks.chaos",
    "exhaustion": "benchmarks.exhaustion",
    "preemption": "benchmarks.preemption",
    "outer": "benchmarks.outer",
    "smallmodel": "benchmarks.smallmodel",
    "nodestore": "benchmarks.nodestore",
    "images": "benchmarks.images",
    "outofcore": "benchmarks.outofcore",
    "demo": "benchmarks.demo",
    "spark": "benchmarks.spark_dataframe",
    "soak": "benchmarks.soak",
    "ddp": "benchmarks.ddp",
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        print(f"usage: python -m benchmarks {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        sys.exit(2)
    importlib.import_module(BENCHMARKS[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
