"""``python -m ddlf.bench NAME``: run a benchmark and record it in BENCHMARKS.md."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "rpc": "ddlf.bench.rpc",
    "tensor": "ddlf.bench.tensor",
    "data": "ddlf.bench.data",
    "train": "ddlf.bench.train",
    "faults": "ddlf.bench.faults",
    "network": "ddlf.bench.network",
    "project": "ddlf.bench.project",
    "elephas": "ddlf.bench.vs_elephas",
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        print(f"usage: python -m ddlf.bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        sys.exit(2)
    importlib.import_module(BENCHMARKS[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
