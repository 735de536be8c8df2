"""The contract of a ring reduction shared by master and workers: its ops and wire formats, checked once."""

from __future__ import annotations

OPS = ("mean", "sum")


WIRES = (None, "float16", "bfloat16")
"""How float32 elements travel between workers: as themselves, or at half precision (sums stay float32)."""


def check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, not {op!r}")
    return op


def check_wire(wire: str | None) -> str | None:
    if wire not in WIRES:
        raise ValueError(f"compression must be None, 'float16' or 'bfloat16', not {wire!r}")
    return wire
