r"""Exceptions raised by ddlf.

Everything ddlf raises derives from :class:`DdlfError` (a few deliberate exceptions, listed below), and every
warning it issues from :class:`DdlfWarning`: ``except ddlf.DdlfError`` catches whatever ddlf raised. Where Python
code expects a built-in exception, ddlf's class derives from both, so ``except ValueError`` keeps working:

* :class:`ConfigError` (``ValueError``): an option, argument or cluster file's value ddlf cannot use;
  :class:`ConfigTypeError` (a ``ConfigError`` and a ``TypeError``) one of the wrong type. :class:`DatasetError`
  and :class:`ModelMismatchError` are ``ValueError``\ s too.
* :class:`NotFoundError` (``KeyError``, so ``LookupError``): a variable, function, dataset or training run that
  is not there; :class:`OutOfRangeError` (``IndexError``): a worker or item index past the end.
* :class:`InvalidStateError` (``RuntimeError``): a call the object's state does not allow;
  :class:`CollectiveError`, :class:`FrameworkClash`, :class:`ResetRefused` and :class:`TooManyRuns` are
  ``RuntimeError``\ s too.
* the connection errors are ``ConnectionError``\ s (:class:`DeadlineExceeded` a ``TimeoutError``),
  :class:`AuthenticationError` a ``PermissionError``, :class:`MemoryBudgetExceeded` a ``MemoryError`` and
  :class:`CheckpointError` an ``OSError``.

Not :class:`DdlfError`\ s, by design: ``NotImplementedError`` from :class:`~ddlf.IApp`'s methods an app
overrides, ``ImportError`` when ``ddlf.callbacks.TensorBoard`` finds no event writer installed, and the worker
daemon's own exits (``SystemExit``). What user code raises on a worker comes back as a :class:`RemoteError`,
whatever its type; one of ddlf's own errors raised on a worker is its class too (a ``RemoteDatasetError`` is a
``RemoteError`` and a :class:`DatasetError`, so ``except ddlf.DatasetError`` and ``except ValueError`` catch a
dataset a worker refused). The compiled extension (``ddlf._ddlf``) checks the arrays handed to its kernels itself, with
plain ``ValueError`` and ``TypeError``.

Errors about one worker carry its ``worker_id`` (its
index in the cluster, when known) and ``address``. A call that fails on several workers raises one error for all
of them, marked :class:`WorkerErrors`, with ``.exceptions`` holding each worker's: an :class:`ExceptionGroup` that
is also their most specific common ddlf class (``except RemoteError`` still catches two workers' errors, and
``except* RemoteError`` sees each one); connection errors differ slightly, see :class:`WorkerErrors`.

The Rust extension builds these classes by type: :data:`_CLASSES` maps each ``ddlf._ddlf.ErrorClass`` to its class.
"""

from __future__ import annotations

import functools
import linecache
import re
import sys
from collections.abc import Sequence
from typing import Any

from ._ddlf import ErrorClass

if sys.version_info < (3, 11):  # pragma: no cover - the backport on Python 3.10
    from exceptiongroup import ExceptionGroup  # type: ignore[import-not-found,unused-ignore]


class DdlfError(Exception):
    """Base class of every ddlf error."""

    def __init__(self, message: str, *, address: str | None = None, worker_id: int | None = None) -> None:
        super().__init__(message)
        self.address = address
        self.worker_id = worker_id


class WorkerUnavailable(DdlfError, ConnectionError):
    """A worker could not be reached, or its connection broke (daemon killed, host down, link cut)."""

    def __init__(
        self,
        message: str,
        *,
        address: str | None = None,
        worker_id: int | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message, address=address, worker_id=worker_id)
        self.reason = reason


class DeadlineExceeded(WorkerUnavailable, TimeoutError):
    """A call did not complete within its ``timeout``. The worker may still be running it."""


class WorkerRestarted(WorkerUnavailable):
    """The daemon at a worker's address restarted since the master connected: what was pushed to it is gone.
    :class:`~ddlf.Cluster` catches this itself, re-provisions the worker and retries the call once."""


class AuthenticationError(DdlfError, PermissionError):
    """The worker refused our token (or we sent none and it requires one). Nothing was run."""


class ProtocolError(DdlfError):
    """Master and worker cannot talk: different protocol versions, or an invalid address."""


class RequestRejected(DdlfError):
    """The worker refused the request itself (too large, malformed). The worker keeps serving."""

    def __init__(
        self,
        message: str,
        *,
        address: str | None = None,
        worker_id: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message, address=address, worker_id=worker_id)
        self.code = code


class MemoryBudgetExceeded(RequestRejected, MemoryError):
    """The worker refused a request, or stopped a call, that would take its resident memory past its budget
    (``ddlf-worker --max-memory``). Nothing of it was kept and the worker keeps serving: delete variables or
    datasets there, or give the worker a larger budget. ``code`` is ``"memory_budget"``."""

    def __init__(
        self,
        message: str,
        *,
        address: str | None = None,
        worker_id: int | None = None,
        code: str | None = "memory_budget",
    ) -> None:
        super().__init__(message, address=address, worker_id=worker_id, code=code)


class CheckpointError(DdlfError, OSError):
    """A training checkpoint could not be written (a full disk, a quota, a read-only directory). The partial file
    was removed and the previous checkpoint is intact; ``errno``, ``strerror`` and ``filename`` are the
    ``OSError``'s."""

    def __init__(self, errno: int, message: str, filename: str) -> None:
        OSError.__init__(self, errno, message, filename)
        self.address = None
        self.worker_id = None

    def __str__(self) -> str:
        return str(self.strerror)


_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in ')


def _with_source(traceback: str) -> str:
    """A formatted remote traceback with the source lines its worker could not show (the script's files are not
    on a remote host) filled from this process's copy of the file, when it has one."""
    lines = traceback.splitlines(keepends=True)
    out: list[str] = []
    for i, line in enumerate(lines):
        out.append(line)
        frame = _FRAME.match(line)
        if frame is None or (i + 1 < len(lines) and lines[i + 1].startswith("    ")):
            continue
        source = linecache.getline(frame["file"], int(frame["line"])).strip()
        if source:
            out.append(f"    {source}\n")
    return "".join(out)


class RemoteError(DdlfError):
    """User code raised an exception on a worker.

    ``remote_type`` is the remote exception's qualified type name, ``remote_message`` its message and
    ``remote_traceback`` the formatted remote traceback (source lines the worker's host lacks are filled from the
    master's files). The worker keeps serving.
    """

    def __init__(
        self,
        message: str,
        *,
        address: str | None = None,
        worker_id: int | None = None,
        remote_type: str = "",
        remote_message: str = "",
        remote_traceback: str = "",
        request_id: int | None = None,
        kind: str = "user",
    ) -> None:
        super().__init__(message, address=address, worker_id=worker_id)
        self.kind = kind
        """``"user"``: user code raised; ``"bad_request"``: the worker could not decode the request's value."""
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = _with_source(remote_traceback)
        self.request_id = request_id
        """The request's id: the worker's log lines about it (``cluster.logs(worker)``) carry ``id=<request_id>``."""

    def __new__(cls, message: str = "", *args: Any, remote_type: str = "", **kwargs: Any) -> RemoteError:
        # One of ddlf's own errors, raised on a worker: also an instance of its class (:func:`_remote_class`).
        chosen = (_remote_class(remote_type) or cls) if cls is RemoteError else cls
        return super().__new__(chosen, message)

    def raised(self, type_name: str) -> bool:
        """Whether the remote exception's type is ``type_name`` (its qualified name's last part: ``"WorkerStopping"``
        matches ``"WorkerStopping"`` and ``"ddlf.errors.CollectiveError"`` matches ``"CollectiveError"``)."""
        return (self.remote_type or "").rsplit(".", 1)[-1] == type_name

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            text += "\n\nRemote traceback:\n" + self.remote_traceback.rstrip()
        return text


_REMOTE_PREFIX = "Remote"


@functools.cache
def _remote_class(remote_type: str) -> type[RemoteError] | None:
    """For ``remote_type`` naming one of ddlf's errors (``ddlf.errors.DatasetError``): ``RemoteDatasetError``, a
    :class:`RemoteError` and a ``DatasetError``. None for other types, for ddlf's errors with a constructor of their
    own, and for ``OSError`` subclasses (whose instances are laid out otherwise)."""
    module, _, name = remote_type.rpartition(".")
    base = globals().get(name) if module == __name__ else None
    if not isinstance(base, type) or base is DdlfError or not issubclass(base, DdlfError):
        return None
    if issubclass(base, RemoteError | OSError):
        return None
    if base.__init__ is not DdlfError.__init__:
        return None
    cls = type(f"{_REMOTE_PREFIX}{name}", (RemoteError, base), {"__module__": __name__, "__doc__": base.__doc__})
    return cls


def __getattr__(name: str) -> Any:
    """``RemoteDatasetError`` and its kind (made on first use), by name: pickle finds them so."""
    if name.startswith(_REMOTE_PREFIX):
        cls = _remote_class(f"{__name__}.{name.removeprefix(_REMOTE_PREFIX)}")
        if cls is not None:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class NotFoundError(DdlfError, KeyError):
    """A function, variable, dataset or training run that is not there (on a worker, or among the workers), or a
    name a lookup does not know. A ``KeyError`` (and so a ``LookupError``) whose message reads as written, not
    quoted as ``KeyError``'s own is."""

    def __init__(
        self,
        message: str,
        *,
        address: str | None = None,
        worker_id: int | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(message, address=address, worker_id=worker_id)
        self.name = name

    def __str__(self) -> str:
        return Exception.__str__(self)  # not KeyError's repr() of the message


class OutOfRangeError(DdlfError, IndexError):
    """An index past the end: a worker the cluster does not have (``workers=[7]`` on two workers), an image
    past the last of :class:`~ddlf.datasets.EncodedImages`."""


class SerializationError(DdlfError):
    """A value could not be pickled or unpickled (on the master or on a worker)."""


class WorkerStartError(DdlfError):
    """A worker daemon could not start (address in use, bad option, ...)."""


class InsecureConfiguration(WorkerStartError):
    """A daemon was asked to listen on a non-loopback address without a token."""


class BadWorkerReply(DdlfError):
    """A worker's training reply was refused before the master merged it: weights of the wrong count, shapes or
    dtypes, top-k indices outside the tensor, an impossible sample count, ... (buggy user code, or a compromised
    host). ``worker_id`` names the worker. Training leaves the reply out of its round (a warning and a
    ``reply_refused`` event in ``History.events``) and goes on with the other workers."""


class NonFiniteUpdate(BadWorkerReply):
    """A worker sent weights (or optimizer state) holding NaN or infinity. ``train(nonfinite="skip")``, the
    default, leaves the reply out like any refused reply; ``nonfinite="raise"`` stops the run with this error."""


class CollectiveError(DdlfError, RuntimeError):
    """A collective among workers (an all-reduce) failed on this worker: a neighbour died, was cut off, refused
    the link, or passed arrays of other sizes. ``peer_rank`` and ``peer_address`` name the neighbour at fault
    (``None`` when the fault is this worker's own). The arrays being reduced are left as they were. On the
    master, training raises it when a round's all-reduce failed on every attempt (the ring gave up)."""

    def __init__(
        self,
        message: str,
        *,
        address: str | None = None,
        worker_id: int | None = None,
        peer_rank: int | None = None,
        peer_address: str | None = None,
    ) -> None:
        super().__init__(message, address=address, worker_id=worker_id)
        self.peer_rank = peer_rank
        self.peer_address = peer_address


class DatasetError(DdlfError, ValueError):
    """A dataset file is missing, malformed or inconsistent. The message names the file."""


class ResetRefused(DdlfError, RuntimeError):
    """``Cluster.reset()`` refused: a worker serves a training run (named in the message, with its app and idle
    time), another master's or one left behind; ``reset(force=True)`` tears it down. No worker was reset."""


class ModelMismatchError(DdlfError, ValueError):
    """The model ``create_model()`` built on a worker cannot be made to agree with the master's model (another
    architecture, another optimizer class): ``create_model`` must build the same model everywhere. Also weights,
    optimizer or metric state that do not fit the model they are given to (another count or shape of arrays)."""


class ConfigError(DdlfError, ValueError):
    """A value ddlf cannot use: an option out of its range or choices (``ddlf.RunConfig(nonfinite="ignore")``), an
    argument that does not fit the call (``cluster.scatter`` with one value too many), a setting of a cluster file
    (the message names the file and line). Nothing was started with it."""


class ConfigTypeError(ConfigError, TypeError):
    """An option or argument of the wrong type (``ddlf.RunConfig(seed="0")``, a ``strategy`` that is not one of
    ddlf's). A ``TypeError``, and a :class:`ConfigError` (so also a ``ValueError``): ``except ddlf.ConfigError``
    catches every refused option."""


class InvalidStateError(DdlfError, RuntimeError):
    """A call that the state of what it is made on does not allow (a step taken out of its order, a plan that
    does not match the ring it is given)."""


class LaunchError(DdlfError):
    """A worker could not be started or did not come up as expected (``ddlf up``)."""


class Preempted(DdlfError):
    """Training stopped at a round boundary because the scheduler signalled (``RunConfig.preemption_signals``):
    the checkpoint of the last merged round is written (``checkpoint``), and ``requeued`` says whether the master
    requeued its Slurm job. A script that trains again with ``resume=True`` goes on from there."""

    def __init__(self, message: str, *, signal: str, checkpoint: str | None, requeued: bool) -> None:
        super().__init__(message)
        self.signal = signal
        self.checkpoint = checkpoint
        self.requeued = requeued

    def __reduce__(self) -> Any:
        # BaseException's calls the class with the message alone: these keywords are required.
        rebuild = functools.partial(type(self), signal=self.signal, checkpoint=self.checkpoint, requeued=self.requeued)
        return rebuild, self.args, vars(self)


class TooManyRuns(DdlfError, RuntimeError):
    """The daemon holds ``max_runs`` training runs already; none of them is idle long enough to evict."""


class RingBusy(TooManyRuns):
    """Another training run that all-reduces worker to worker (gradient averaging; model averaging over a ``Ring``)
    holds the daemon: two such runs on the same workers would each wait on a round the other's holds up (a worker
    runs one call at a time). A master told so tears its set-up down and waits for the other run to end."""


class FrameworkClash(DdlfError, RuntimeError):
    """Loading a framework now would abort the process: PyTorch's compiler (``torch._dynamo``, which every
    ``torch.optim`` optimizer loads) after TensorFlow, where ``triton`` is installed (two copies of LLVM). The
    message says what to do; nothing was loaded (see :mod:`ddlf.frameworks.loading`). Also a worker that runs
    Keras on another backend than the master's, loaded already (a process cannot switch)."""


# -- warnings -------------------------------------------------------------------------------------------------


class DdlfWarning(Warning):
    """Base class of every warning ddlf issues: ``warnings.filterwarnings("ignore", category=ddlf.DdlfWarning)``
    silences them all, a subclass one kind."""


class WorkerLostWarning(DdlfWarning, RuntimeWarning):
    """A worker stopped answering; training goes on without it (``history.events`` records it) and takes it back
    when it returns."""


class ReplyRefusedWarning(DdlfWarning, RuntimeWarning):
    """A worker's reply to a round was malformed or not finite and was left out of the round."""


class NonFiniteGradientsWarning(DdlfWarning, RuntimeWarning):
    """A worker's gradients held NaN or infinity; those batches were left out of their steps."""


class WireOverflowWarning(DdlfWarning, RuntimeWarning):
    """An update overflowed float16 on the ring and was skipped on every worker."""


class OptimizerStateWarning(DdlfWarning, RuntimeWarning):
    """The master's model could not take the run's optimizer state (``ddlf.training.master_optimizer``): the
    trained weights are kept; its optimizer is not what ``fit`` would leave."""


class ModelChangeWarning(DdlfWarning, RuntimeWarning):
    """A change to the master's model (a recompile, a ``trainable`` flag, an optimizer hyperparameter) that the
    workers could not take where it was made: the warning says when they take it, or that they do not."""


class ConfigWarning(DdlfWarning, UserWarning):
    """An option that works but is probably not what was meant: ``train()``'s ``validation_freq`` names no epoch
    of the run (no ``val_*`` logs), or ``DataConfig.rotate_shards_every`` is not reached before the run ends (the
    shards never rotate)."""


class WorkerErrors:
    """Marks the error of a call that failed on several workers: :attr:`exceptions` holds each worker's error, in
    worker order, and the error itself carries the first one's attributes (``worker_id``, ``address``, ...).

    It is a :class:`WorkerErrorGroup` (an :class:`ExceptionGroup`) that is also the errors' most specific common
    ddlf class, so both ``except RemoteError`` and ``except* RemoteError`` work. The connection errors
    (:class:`WorkerUnavailable`, :class:`DeadlineExceeded`, :class:`WorkerRestarted`, :class:`AuthenticationError`)
    are also ``OSError``\\ s, a layout Python lets no class share with ``ExceptionGroup``: several of those raise
    the common class itself (``except DeadlineExceeded`` and ``except TimeoutError`` keep working, and ``except*``
    matches it whole) with :attr:`exceptions` listing every worker's error.
    """

    exceptions: tuple[BaseException, ...]


class WorkerErrorGroup(ExceptionGroup, DdlfError, WorkerErrors):
    """Several workers failed one call (see :class:`WorkerErrors`). Build one with :func:`group`."""

    def __new__(cls, message: str, exceptions: Sequence[Exception]) -> WorkerErrorGroup:
        return super().__new__(cls, message, exceptions)

    def __init__(self, message: str, exceptions: Sequence[Exception]) -> None:
        self.__dict__.update(vars(exceptions[0]))

    def derive(self, excs: Sequence[Exception]) -> Any:
        # split() and subgroup() need a group back, even of one error: the class of what is left.
        cls = _group_class(_common_class(excs))
        return (
            cls(self.message, list(excs))
            if issubclass(cls, WorkerErrorGroup)
            else WorkerErrorGroup(self.message, list(excs))
        )


_GROUP_CLASSES: dict[type, type] = {}


def group(errors: Sequence[Any], message: str | None = None) -> BaseException:
    """One exception for a call's per-worker errors: the error itself when there is one, else a
    :class:`WorkerErrors` exception of their most specific common ddlf class."""
    if len(errors) == 1:
        return errors[0]
    if message is None:
        message = f"{len(errors)} workers failed; the first, {errors[0]}"
    cls = _group_class(_common_class(errors))
    if issubclass(cls, WorkerErrorGroup):
        return cls(message, list(errors))
    exc: Any = cls.__new__(cls, message)  # type: ignore[call-arg]
    BaseException.__init__(exc, message)
    exc.__dict__.update(vars(errors[0]))
    exc.exceptions = tuple(errors)
    return exc


def _common_class(errors: Sequence[BaseException]) -> type:
    """The most specific ddlf class every error is an instance of."""
    for c in type(errors[0]).__mro__:
        if issubclass(c, DdlfError) and all(isinstance(e, c) for e in errors):
            return c
    return DdlfError


def _group_class(base: type) -> type:
    if base not in _GROUP_CLASSES:
        name = f"{base.__name__}Group"
        if base is DdlfError:
            _GROUP_CLASSES[base] = WorkerErrorGroup
        elif issubclass(base, OSError):  # no common layout with ExceptionGroup
            _GROUP_CLASSES[base] = type(name, (base, WorkerErrors), {"__module__": __name__})
        else:
            _GROUP_CLASSES[base] = type(name, (WorkerErrorGroup, base), {"__module__": __name__})
    return _GROUP_CLASSES[base]


def raise_for(outcomes: list[Any]) -> list[Any]:
    """Return ``outcomes`` if none is an exception; otherwise raise the one error, or a group of them."""
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    if errors:
        raise group(errors)
    return outcomes


_CLASSES: dict[ErrorClass, type[DdlfError]] = {
    ErrorClass.WorkerUnavailable: WorkerUnavailable,
    ErrorClass.DeadlineExceeded: DeadlineExceeded,
    ErrorClass.WorkerRestarted: WorkerRestarted,
    ErrorClass.AuthenticationError: AuthenticationError,
    ErrorClass.ProtocolError: ProtocolError,
    ErrorClass.RequestRejected: RequestRejected,
    ErrorClass.RemoteError: RemoteError,
    ErrorClass.NotFoundError: NotFoundError,
    ErrorClass.SerializationError: SerializationError,
    ErrorClass.WorkerStartError: WorkerStartError,
    ErrorClass.InsecureConfiguration: InsecureConfiguration,
    ErrorClass.CollectiveError: CollectiveError,
    ErrorClass.MemoryBudgetExceeded: MemoryBudgetExceeded,
}
"""What the Rust extension raises for each of its error classes (complete: checked by the unit tests)."""


__all__ = [
    "AuthenticationError",
    "BadWorkerReply",
    "CheckpointError",
    "CollectiveError",
    "ConfigError",
    "ConfigTypeError",
    "ConfigWarning",
    "DatasetError",
    "DdlfError",
    "DdlfWarning",
    "DeadlineExceeded",
    "FrameworkClash",
    "InsecureConfiguration",
    "InvalidStateError",
    "LaunchError",
    "MemoryBudgetExceeded",
    "ModelChangeWarning",
    "ModelMismatchError",
    "NonFiniteGradientsWarning",
    "NonFiniteUpdate",
    "NotFoundError",
    "OptimizerStateWarning",
    "OutOfRangeError",
    "Preempted",
    "ProtocolError",
    "RemoteError",
    "ReplyRefusedWarning",
    "RequestRejected",
    "ResetRefused",
    "RingBusy",
    "SerializationError",
    "TooManyRuns",
    "WireOverflowWarning",
    "WorkerErrorGroup",
    "WorkerErrors",
    "WorkerLostWarning",
    "WorkerRestarted",
    "WorkerStartError",
    "WorkerUnavailable",
]
