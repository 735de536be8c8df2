"""The contract of a ring reduction shared by master and workers: what a member needs to join a ring
(:class:`RingSpec`), and a reduction's ops and wire formats.

One type on both sides: the master's plan (:meth:`ddlf.cluster.rings.RingPlan.spec`) makes a ``RingSpec`` for each
member, it travels to the worker as it is, and the worker's ring (``ddlf._ddlf.Ring``) is built from it. Rust reads
it field by field (``PySpec`` in ``rust/ddlf-py/src/collective.rs``) and holds its checks, once: a spec is checked
when it is made, by the same code that checks it again where the ring is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _ddlf
from .errors import ConfigError

OPS = ("mean", "sum")

WIRES = (None, "float16", "bfloat16")
"""How float32 elements travel between workers: as themselves, or at half precision (sums stay float32)."""


@dataclass(frozen=True)
class LocalRing:
    """A member's place among the members on its host, in a hierarchical ring: its ``index`` there, their
    ``addresses`` (the first one joins the ring between hosts), and the ring's ``total`` members."""

    index: int
    addresses: tuple[str, ...]
    total: int


@dataclass(frozen=True)
class RingSpec:
    """What one member needs to join a ring: the ring's ``group`` (a uuid4 hex), its ``rank`` among
    ``addresses`` (with ``local``: among the hosts' first members), the links per neighbour (``streams``), how
    long to wait for the others (``timeout``) and to notice a neighbour that stops answering (``liveness``), and
    the certificate authority and name of a TLS cluster. Checked when made (see the module docs)."""

    group: str
    rank: int
    addresses: tuple[str, ...]
    streams: int = 1
    timeout: float = 300.0
    liveness: float = 10.0
    tls_ca: bytes | None = None
    tls_domain: str | None = None
    local: LocalRing | None = None

    def __post_init__(self) -> None:
        _ddlf.check_ring_spec(self)


def check_op(op: str) -> str:
    """``op`` if it is a reduction ring members do (``"sum"``, ``"mean"``); else :class:`~ddlf.errors.ConfigError`."""
    try:
        _ddlf.check_reduction(op)
    except ValueError as exc:  # the extension's own
        raise ConfigError(str(exc)) from None
    return op


def check_wire(wire: str | None, name: str = "compression") -> str | None:
    """``wire`` if float32 elements can travel so (None, ``"float16"``, ``"bfloat16"``); else
    :class:`~ddlf.errors.ConfigError`,
    naming the argument as the caller called it (``name``)."""
    try:
        _ddlf.check_reduction("sum", wire)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return wire
