"""Collectives among a cluster's workers, as :class:`~ddlf.Cluster` offers them: ``allreduce`` of a worker variable
and the rings that users' own worker functions reduce on (planned by :mod:`.rings`, run by
:mod:`ddlf.worker.reduction`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..ring_spec import check_op, check_wire
from ..worker import reduction as worker_collective
from .calls import FunctionRef
from .rings import RingPlan, Rings, shares_hosts


class Collectives:
    """The collective verbs of :class:`~ddlf.Cluster` (mixed into it; they use only its public verbs)."""

    _rings: Rings
    _tls: tuple[bytes, str | None] | None
    timeout: float | None
    heartbeat_timeout: float

    if TYPE_CHECKING:  # what the mixin uses of Cluster

        @property
        def addresses(self) -> list[str]: ...
        def instance(self, worker: int) -> int: ...
        def _targets(self, workers: Iterable[int] | None) -> list[int]: ...
        def run_each(
            self,
            fn: FunctionRef,
            args: Sequence[Sequence[Any]],
            kwargs: Sequence[dict[str, Any]] | None = None,
            *,
            workers: Sequence[int] | None = None,
            timeout: float | None = None,
            return_exceptions: bool = False,
        ) -> list[Any]: ...

    def allreduce(
        self,
        name: str,
        op: str = "mean",
        *,
        workers: Iterable[int] | None = None,
        streams: int = 1,
        timeout: float | None = None,
        compression: str | None = None,
        hierarchical: bool | None = None,
    ) -> None:
        """Reduce the worker variable ``name`` (a numpy array, or a list or tuple of them: float32 or float64,
        the same shapes on every worker) across the workers, in place: afterwards every worker holds the
        element-wise ``"mean"`` (or ``"sum"``). The workers exchange the data among themselves over a ring
        (each sends and receives ``2(n-1)/n`` times the variable, whatever ``n``); nothing of it passes through
        the master.

        ``streams``: parallel links per neighbour (for links one TCP stream cannot fill). ``timeout``: how long
        a worker waits for the others to join, default the cluster's ``timeout`` or 300 s. A worker that dies
        or is cut off fails the call on every worker (its neighbours notice within ``heartbeat_timeout``),
        raising :class:`~ddlf.errors.WorkerUnavailable` for it and the survivors' ``CollectiveError``\\ s; the
        variable is then unchanged on the survivors. Rings are kept between calls on the same workers (their
        links stay open) and formed anew after a failure.

        ``compression="float16"|"bfloat16"``: float32 arrays travel at half precision (half the bytes on every
        link; sums stay float32 and every worker ends with the same bits; float16 overflows past 65504, bfloat16
        keeps float32's range with 8 bits of mantissa).

        ``hierarchical``: workers on one host reduce through shared memory and only one per host joins the ring
        between hosts (see :meth:`ring`; default: when some host runs more than one of them).
        """
        check_op(op)
        check_wire(compression)
        plan = self.ring(workers, streams=streams, timeout=timeout, hierarchical=hierarchical)
        # Every member's variable checked first, and compared: one that is missing, of another dtype or shape fails
        # the call on all of them at once (in the ring, the others would wait out the timeout for it).
        members = list(plan.workers)
        described = self.run_each(
            worker_collective.describe_variable, [(name,)] * len(members), workers=members, timeout=timeout
        )
        for w, d in zip(members, described):
            if d != described[0]:
                raise ConfigError(
                    f"allreduce: variable {name!r} differs between workers: worker {members[0]} holds "
                    f"{_describe(described[0])}, worker {w} {_describe(d)}; every worker must hold the same "
                    "dtypes and shapes (nothing was reduced)"
                )
        args = [(name, plan.spec(w), op, compression) for w in plan.workers]
        try:
            self.run_each(worker_collective.allreduce_variable, args, workers=list(plan.workers), timeout=timeout)
        except BaseException:
            self.retire_ring(plan)  # spent on the workers: the next call forms a new ring
            raise

    def ring(
        self,
        workers: Iterable[int] | None = None,
        *,
        streams: int = 1,
        timeout: float | None = None,
        hierarchical: bool | None = None,
    ) -> RingPlan:
        """The ring of ``workers`` (default all), in that order: kept between calls while it works. Pass
        ``ring.spec(w)`` to worker ``w``'s own function, which reduces with ``ddlf.collective.reduce_arrays``;
        after a failed reduction, :meth:`retire_ring` it. ``timeout``: how long a worker waits for the others to
        join, default the cluster's ``timeout`` or 300 s; a neighbour that stops answering is noticed within
        ``heartbeat_timeout``. On a cluster that uses TLS the workers' peer links do too: each checks its
        neighbour's certificate against the master's ``tls_ca`` (for ``tls_domain`` if given, else the
        neighbour's host), as the master checks theirs.

        ``hierarchical`` (default: when some host runs more than one of the workers): the workers on one host
        (the same host in their addresses) sum through shared memory, only the first of each host joins the ring
        between hosts, and the result fans back out through shared memory; loopback TCP carries nothing. Every
        worker still ends with the same bits. ``False``: one flat ring of every worker."""
        targets = self._targets(workers)
        addresses = [self.addresses[w] for w in targets]
        if hierarchical is None:
            hierarchical = shares_hosts(addresses)
        return self._rings.plan(
            targets,
            [self.addresses[w] for w in targets],
            [self.instance(w) for w in targets],
            streams=streams,
            timeout=timeout or self.timeout or 300.0,
            liveness=max(1.0, self.heartbeat_timeout),
            tls=self._tls,
            hierarchical=bool(hierarchical),
        )

    def retire_ring(self, ring: RingPlan) -> None:
        """Forget a ring that failed (its workers closed its links): the next :meth:`ring` of those workers is a
        new one."""
        self._rings.retire(ring)


def _describe(arrays: list[tuple[str, tuple[int, ...]]]) -> str:
    """``float32 (3, 4)``, or a list of them."""
    parts = [f"{dtype} {tuple(shape)}" for dtype, shape in arrays]
    return parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
