"""Type stubs for ``ddlf._ddlf``, the Rust extension module (see rust/ddlf-py)."""

import os
from collections.abc import Sequence
from typing import Any, final

from typing_extensions import Buffer, Self

__version__: str
"""The package version, shared by the master and the worker daemon (the Rust crates' version)."""
PROTOCOL_VERSION: int
"""The wire protocol's version: bumped whenever a message changes incompatibly. Master and worker compare it at
connect time (a worker of another version is refused with :class:`~ddlf.errors.ProtocolError`)."""
OPS: dict[str, int]
"""Operation codes of the wire protocol, by name without the ``OP_`` prefix."""
ERROR_KINDS: dict[str, int]
"""Error kinds of the wire protocol, by name without the ``ERROR_KIND_`` prefix."""

@final
class ErrorClass:
    """The exception classes Rust errors become; ``ddlf.errors._CLASSES`` maps each to its Python class."""

    WorkerUnavailable: ErrorClass
    DeadlineExceeded: ErrorClass
    WorkerRestarted: ErrorClass
    AuthenticationError: ErrorClass
    ProtocolError: ErrorClass
    RequestRejected: ErrorClass
    RemoteError: ErrorClass
    NotFoundError: ErrorClass
    SerializationError: ErrorClass
    WorkerStartError: ErrorClass
    InsecureConfiguration: ErrorClass
    CollectiveError: ErrorClass
    MemoryBudgetExceeded: ErrorClass
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __int__(self) -> int: ...

@final
class Reply:
    """One worker's answer to a call: a value (``pickle`` and ``buffers``) or an ``error`` (an exception instance
    of :mod:`ddlf.errors`, not raised)."""

    @property
    def worker(self) -> int: ...
    @property
    def pickle(self) -> bytes | None: ...
    @property
    def buffers(self) -> list[RecvBuffer]: ...
    @property
    def error(self) -> BaseException | None: ...
    @property
    def worker_seconds(self) -> float:
        """Seconds the worker's interpreter spent on the call."""
    @property
    def call_seconds(self) -> float:
        """Seconds from sending the request to having the whole reply."""
    @property
    def request_id(self) -> int: ...

@final
class RecvBuffer:
    """Bytes received from the network (or a collective's result in a host's shared memory), exposed through the
    buffer protocol without a copy."""

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class Client:
    """Connections to worker daemons. Every method releases the GIL while it waits and is interruptible."""

    def __new__(
        cls,
        addresses: Sequence[str],
        token: str | None = None,
        connect_timeout: float = 10.0,
        keepalive_interval: float = 5.0,
        keepalive_timeout: float = 10.0,
        shared_memory: bool = False,
        tls_ca: bytes | None = None,
        tls_domain: str | None = None,
        direct_lane: bool = True,
        lane_spin_us: int | None = None,
    ) -> Self: ...
    @property
    def addresses(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def worker_info(self) -> list[dict[str, Any]]:
        """Per worker: its hello (version, protocol_version, name, pid, hostname, instance) and this connection's
        ``shared_memory``, ``direct_lane`` and ``ping_lane`` (open now)."""
    def reconnect(self, index: int, timeout: float | None = None) -> dict[str, Any]:
        """A fresh connection to worker ``index``'s address; returns its hello info (with ``instance``)."""
    def add(self, address: str, timeout: float | None = None) -> int:
        """Connect to one more worker; returns its index."""
    def remove(self, index: int) -> str:
        """Drop worker ``index``'s connection; returns its address."""
    def heartbeat(
        self, targets: Sequence[int], timeout: float | None = None
    ) -> list[tuple[float, int] | BaseException]:
        """``(round-trip seconds, daemon instance id)`` per target, or the exception of one that did not answer."""
    def call(
        self,
        targets: Sequence[int],
        op: int,
        name: str,
        digest: str,
        pickle: bytes,
        buffers: Sequence[Buffer],
        timeout: float | None = None,
    ) -> list[Reply]: ...
    def call_each(
        self,
        targets: Sequence[int],
        op: int,
        name: str,
        digest: str,
        values: Sequence[tuple[bytes, Sequence[Buffer]]],
        timeout: float | None = None,
    ) -> list[Reply]: ...
    def status(self, targets: Sequence[int], timeout: float | None = None) -> list[dict[str, Any] | BaseException]: ...
    def stacks(self, targets: Sequence[int], timeout: float | None = None) -> list[dict[str, Any] | BaseException]:
        """Every Python thread's stack and what the interpreter thread serves, per target, or an exception."""
    def logs(
        self, targets: Sequence[int], lines: int = 100, timeout: float | None = None
    ) -> list[tuple[list[str], int] | BaseException]:
        """``(last log lines, lines dropped from the daemon's buffer)`` per target, or an exception."""
    def shutdown(self, targets: Sequence[int], timeout: float | None = None) -> list[BaseException | None]: ...

def serve_worker(
    executor: Any,
    listen: str,
    token: str | None = None,
    insecure: bool = False,
    max_message_size: int | None = None,
    name: str | None = None,
    network_threads: int = 1,
    tls_cert: bytes | None = None,
    tls_key: bytes | None = None,
    max_connections: int | None = None,
    handshake_timeout: float | None = None,
    lane_spin_us: int | None = None,
    keepalive: tuple[float, float] | None = None,
) -> None:
    """Run a worker daemon in this process until shutdown or a signal; this thread runs the jobs."""

def init_logging(default: str = "warn") -> bool:
    """Send Rust ``tracing`` logs to stderr, filtered by ``DDLF_LOG``/``RUST_LOG`` (else ``default``), and keep the
    recent lines in memory for the ``Logs`` RPC, filtered by ``DDLF_LOG_KEEP``."""

def log_record(level: int, logger: str, message: str) -> None:
    """Log a Python ``logging`` record through Rust ``tracing`` (``level``: Python's numeric level)."""

@final
class ServingDaemon:
    """The daemon serving this worker process, handed to its executor's ``on_listening``."""

    def set_runs(self, runs: list[str]) -> None:
        """Replace the training runs the daemon reports in its status."""

    def runs(self) -> list[str]:
        """The training runs the daemon reports."""

    def set_stack_dumper(self, signal: int, path: str | os.PathLike[str]) -> None:
        """Answer stack requests by raising ``signal`` (faulthandler registered on it, appending to ``path``).

        The daemon opens ``path`` here and keeps it open: its name may be removed once this returns.
        """

@final
class BatchPipeline:
    """Batches of dataset rows gathered by a Rust prefetch thread, or for a partition of at most 1 MiB of rows in
    memory on the iterating thread (see ``ddlf.ops.BatchPipeline``)."""

    def __new__(
        cls,
        arrays: Sequence[Any],
        indices: Any,
        batch_size: int,
        prefetch: int = 2,
        drop_last: bool = False,
        decode_threads: int | None = None,
        seed: int = 0,
        inline: bool | None = None,
    ) -> Self: ...
    @property
    def inline(self) -> bool:
        """Whether the batches are gathered on the iterating thread (no prefetch thread runs)."""
    def __len__(self) -> int: ...
    def __iter__(self) -> BatchPipeline: ...
    def __next__(self) -> Any: ...
    def stats(self) -> dict[str, float]: ...

def check_ring_spec(spec: Any) -> None:
    """Raise ``ValueError`` if ``spec`` (a ``RingSpec``) cannot form a ring: what building its ``Ring`` checks."""

def check_reduction(op: str, wire: str | None = None) -> None:
    """Raise ``ValueError`` unless ``op`` is "sum" or "mean" and ``wire`` None, "float16" or "bfloat16"."""

def leave_rings() -> None:
    """This worker is stopping: from now on its daemon answers ring links and liveness probes with "stopping",
    so a ring waiting on it fails at its next probe (a quarter of the ring's liveness bound). For good."""

def weighted_average(lists: Sequence[Sequence[Any]], weights: Sequence[float] | None = None) -> list[Any]: ...
def axpy_(weights: Sequence[Any], delta: Sequence[Any], alpha: float = 1.0) -> None: ...
def delta(new: Sequence[Any], old: Sequence[Any]) -> list[Any]: ...
def to_half(arrays: Sequence[Any], dtype: str = "float16") -> list[Any]: ...
def from_half(arrays: Sequence[Any], bfloat16: Sequence[bool] | None = None) -> list[Any]: ...
def topk(arrays: Sequence[Any], ratio: float) -> list[tuple[Any, Any]]: ...
def permutation(n: int, seed: int, epoch: int) -> Any: ...
def partitions(n: int, seed: int, epoch: int, shares: Sequence[float]) -> list[Any]: ...
def partition_for(n: int, seed: int, epoch: int, shares: Sequence[float], worker: int) -> Any: ...
def split_sizes(n: int, shares: Sequence[float]) -> list[int]: ...
def gather(array: Any, indices: Any) -> Any: ...
def decode_images(images: Any, indices: Any, threads: int | None = None) -> Any: ...
def release_shared_memory() -> None:
    """Remove this process's pooled shared-memory segments (called at exit)."""

def shared_memory_usage() -> tuple[int, int]:
    """``(segments, bytes)`` held in this process's shared-memory pool."""

def tune_allocator() -> bool:
    """Apply the allocator policy for large transfers (once; ``DDLF_MALLOC=system`` keeps glibc's defaults).
    Returns whether this process runs with it."""

def return_free_memory() -> bool:
    """Hand the allocator's free memory back to the kernel (glibc's ``malloc_trim``; the interpreter lock is
    released meanwhile). Returns whether any was released."""

@final
class Ring:
    """One worker's rank in a ring all-reduce among workers (``ddlf.collective``), built from a
    :class:`ddlf.ring_spec.RingSpec` (checked again here). Links open on the first reduction and stay open for the
    next; a ring that fails once is spent. With the spec's ``tls_ca`` the peer links use TLS; with its ``local``
    the host's members reduce through shared memory and only local index 0 joins the ring between hosts."""

    def __new__(cls, spec: Any) -> Ring: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    def allreduce_(
        self,
        arrays: list[Any],
        op: str = "mean",
        atomic: bool = True,
        wire: str | None = None,
        out: list[Any] | None = None,
    ) -> None:
        """Reduce ``arrays`` (C-contiguous, writable, all float32 or all float64) with the other ranks, in place;
        raises ``ddlf.errors.CollectiveError`` (the arrays then unchanged, unless ``atomic=False``: one array
        reduced where it lies, no copy, undefined after a failure). ``wire="float16"|"bfloat16"``: float32
        elements travel at half precision, sums stay float32, every rank ends with the same bits. ``out``:
        writable arrays of the same dtype and as many elements in all, which receive the result (``arrays`` then
        only read, and may be read-only; on one host's shared memory no copy is added; ``out`` undefined after a
        failure)."""
    @property
    def shares_results(self) -> bool:
        """Whether :meth:`allreduce_shared_` can leave a result in shared memory: one host holds every rank."""
    def allreduce_shared_(self, arrays: list[Any], op: str = "mean", tag: int = 1) -> RecvBuffer:
        """Reduce ``arrays`` (float32 or float64 of one dtype, only read: they may be read-only and may share
        memory) and return the result's bytes where the host's shared memory holds them (read-only: the host's
        members share them; cache-line aligned; ``numpy.frombuffer`` makes the flat array), with no copy out. Only where
        :attr:`shares_results`. Rewritten by the next call with the same ``tag`` (1 or more, every rank alike):
        read the result before making it."""
    def shard(self, len: int) -> tuple[int, int]:
        """``(start, stop)``: the elements of an array of ``len`` this rank owns between :meth:`reduce_scatter_`
        and :meth:`allgather_` (disjoint across ranks, covering the array, the same on every call)."""
    def reduce_scatter_(self, array: Any, op: str = "mean", wire: str | None = None) -> tuple[int, int]:
        """The first half of an all-reduce, in place: ``array[start:stop]`` (this rank's shard, returned) ends
        with the sum or mean over the ranks, the rest with values that mean nothing. Raises
        ``ddlf.errors.CollectiveError`` (the array then undefined)."""
    def allgather_(self, array: Any, wire: str | None = None) -> None:
        """The second half of an all-reduce, in place: every rank passes ``array`` with its shard filled in and
        ends with every rank's shard (``wire``: each shard travels rounded to half precision, and its owner keeps
        the rounded value). Raises ``ddlf.errors.CollectiveError`` (the array then undefined)."""
