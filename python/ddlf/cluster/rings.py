"""The master's rings: which workers reduce together, in which order, and what each member needs to join."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..ring_spec import LocalRing, RingSpec


@dataclass(frozen=True)
class RingPlan:
    """A ring the master formed: its members (worker indices, in ring order) and their addresses.

    ``timeout``: how long a member waits for the others to join (one may still be computing) and the longest a
    neighbour may stall mid-reduction; ``liveness``: a neighbour whose host stops answering is detected within
    about this long (TCP keepalive), one whose process dies at once. ``tls``: the certificate authority (PEM) and
    the name to check certificates for (``None``: each neighbour's host) of a cluster that uses TLS; members
    then open TLS peer links. ``hierarchical``: members on one host (the same address host) reduce through shared
    memory and only each host's first member joins the ring between hosts (:meth:`spec` says who is where).
    """

    workers: tuple[int, ...]
    addresses: tuple[str, ...]
    streams: int = 1
    timeout: float = 300.0
    liveness: float = 10.0
    tls: tuple[bytes, str | None] | None = None
    hierarchical: bool = False
    group: str = field(default_factory=lambda: uuid.uuid4().hex)

    def hosts(self) -> list[list[int]]:
        """The members grouped by host (the host part of their address), hosts in order of first appearance."""
        groups: dict[str, list[int]] = {}
        for w, address in zip(self.workers, self.addresses):
            groups.setdefault(host_of(address), []).append(w)
        return list(groups.values())

    def spec(self, worker: int) -> RingSpec:
        """What member ``worker`` needs to join (its rank and everyone's address)."""
        local: LocalRing | None = None
        rank, addresses = self.workers.index(worker), list(self.addresses)
        if self.hierarchical:
            hosts = self.hosts()
            where = {w: (h, j) for h, members in enumerate(hosts) for j, w in enumerate(members)}
            address = dict(zip(self.workers, self.addresses))
            rank, index = where[worker]
            addresses = [address[members[0]] for members in hosts]
            local = LocalRing(index, tuple(address[w] for w in hosts[rank]), len(self.workers))
        return RingSpec(
            group=self.group,
            rank=rank,
            addresses=tuple(addresses),
            streams=self.streams,
            timeout=self.timeout,
            liveness=self.liveness,
            tls_ca=self.tls[0] if self.tls else None,
            tls_domain=self.tls[1] if self.tls else None,
            local=local,
        )

    def __post_init__(self) -> None:
        if not self.workers or len(self.workers) != len(self.addresses):
            raise ConfigError("a ring needs at least one worker and one address per worker")
        self.spec(self.workers[0])  # the spec's own checks (streams, timeout, liveness, TLS), made once, in Rust


class Rings:
    """The master's rings, one per (workers, their daemon instances, streams): kept while it works (the workers
    keep its links open), retired after a failure so that the next request forms a new one (a new group). A
    restarted daemon has another instance, so it never gets a ring whose links died with its old process."""

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], RingPlan] = {}

    def plan(
        self,
        workers: Sequence[int],
        addresses: Sequence[str],
        instances: Sequence[int],
        *,
        streams: int = 1,
        timeout: float = 300.0,
        liveness: float = 10.0,
        tls: tuple[bytes, str | None] | None = None,
        hierarchical: bool = False,
    ) -> RingPlan:
        key = (tuple(workers), tuple(instances), streams, hierarchical)
        plan = self._plans.get(key)
        if plan is None or plan.addresses != tuple(addresses):
            plan = RingPlan(
                tuple(workers),
                tuple(addresses),
                streams=streams,
                timeout=timeout,
                liveness=liveness,
                tls=tls,
                hierarchical=hierarchical,
            )
            self._plans[key] = plan
        return plan

    def retire(self, plan: RingPlan) -> None:
        """Forget ``plan`` (it failed): the next request for its workers forms a new ring."""
        self._plans = {k: p for k, p in self._plans.items() if p.group != plan.group}


def host_of(address: str) -> str:
    """The host part of a ``host:port`` address (IPv6 brackets removed)."""
    return address.rsplit(":", 1)[0].strip("[]")


def shares_hosts(addresses: Sequence[str]) -> bool:
    """Whether some host holds more than one of ``addresses`` (where a hierarchical ring pays)."""
    hosts = [host_of(a) for a in addresses]
    return len(set(hosts)) < len(hosts)
