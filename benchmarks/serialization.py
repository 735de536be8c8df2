"""How fast values are pickled for the workers: ``ddlf.serialization.dumps`` against the C pickler
(``pickle.dumps``, the floor) and ``cloudpickle.dumps``, interleaved in one run, on plain data and on values
defined in the script (which must travel by value)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import pickle
import time
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np

from ddlf import serialization

from . import report


@dataclasses.dataclass
class ImportableConfig:
    """A dataclass the workers can import: pickled by reference (the floor for the one below)."""

    lr: float
    layers: tuple[int, ...]


@dataclasses.dataclass
class ScriptConfig:
    """Stands for a dataclass defined in the user's script (its module is set to ``__main__`` below)."""

    lr: float
    layers: tuple[int, ...]


ScriptConfig.__module__ = "__main__"  # as if defined in the script: it must travel by value


def _cases() -> dict[str, Any]:
    return {
        "call arguments ((1, 2.0, 'x'), {})": ((1, 2.0, "x"), {}),
        "weight list, 4 MB in 20 arrays": [np.zeros(50_000, np.float32) for _ in range(20)],
        "dict of 10,000 floats": {str(i): float(i) for i in range(10_000)},
        "10,000 datetimes": [datetime.datetime(2020, 1, 1, 0, i // 60 % 60, i % 60) for i in range(10_000)],
        "10,000 numpy scalars": [np.float64(i) for i in range(10_000)],
        "a script dataclass (by value)": ScriptConfig(0.1, (32, 10)),
    }


def _pickle(value: Any) -> Any:
    buffers: list[Any] = []
    return pickle.dumps(value, protocol=5, buffer_callback=buffers.append)


def _cloudpickle(value: Any) -> Any:
    buffers: list[Any] = []
    return cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)


def _ddlf(value: Any) -> Any:
    return serialization.dumps(value, modules=set())


def _time(fn: Callable[[Any], Any], value: Any, number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn(value)
    return (time.perf_counter() - t0) / number


def measure(repeats: int) -> list[list[str]]:
    rows = []
    for label, value in _cases().items():
        fns = {"pickle": _pickle, "cloudpickle": _cloudpickle, "ddlf": _ddlf}
        # The floor for a script class is the same class pickled by reference (which a worker could not load).
        floor_value = ImportableConfig(value.lr, value.layers) if isinstance(value, ScriptConfig) else value
        number = max(1, int(0.02 / max(_time(_cloudpickle, value, 1), 1e-7)))
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):  # interleaved
            for key, fn in fns.items():
                samples[key].append(_time(fn, floor_value if key == "pickle" else value, number))
        med = {k: report.median(v) for k, v in samples.items()}
        floor = "(by reference)" if floor_value is not value else ""
        rows.append(
            [
                label,
                f"{med['pickle'] * 1e6:.1f} {floor}".strip(),
                f"{med['cloudpickle'] * 1e6:.1f} ({med['cloudpickle'] / med['pickle']:.2f}x)",
                f"{med['ddlf'] * 1e6:.1f} ({med['ddlf'] / med['pickle']:.2f}x)",
            ]
        )
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks serialization", description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    rows = measure(args.repeats)
    table = report.table(["value", "pickle.dumps µs (floor)", "cloudpickle.dumps µs", "ddlf dumps µs"], rows)
    body = f"""## Pickling values for the workers (`python -m benchmarks serialization`)

{report.machine()}

Medians of {args.repeats} interleaved repeats, each timing a loop of ~20 ms. ddlf's `dumps` runs the C pickler with
a `reducer_override` hook (called only for objects that are not built-in containers or scalars) that stops at the
first class or function of `__main__`, then pickles that value with cloudpickle (script code by value) and notes
the local modules it refers to (shipped to the workers). Ratios are against `pickle.dumps` in the same run.

{table}
"""
    print(body)
    report.write_section("serialization", body)
