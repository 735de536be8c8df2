"""Exceptions raised by ddlf.

Everything ddlf raises derives from :class:`DdlfError`. Errors about one worker carry its ``worker_id`` (its
index in the cluster, when known) and ``address``.
"""

from __future__ import annotations


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


class RemoteError(DdlfError):
    """User code raised an exception on a worker.

    ``remote_type`` is the remote exception's qualified type name, ``remote_message`` its message and
    ``remote_traceback`` the formatted remote traceback. The worker keeps serving.
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
    ) -> None:
        super().__init__(message, address=address, worker_id=worker_id)
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.request_id = request_id
        """The request's id: the worker's log lines about it (``cluster.logs(worker)``) carry ``id=<request_id>``."""

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            text += "\n\nRemote traceback:\n" + self.remote_traceback.rstrip()
        return text


class NotFoundError(DdlfError, LookupError):
    """A function, variable or dataset name that the worker does not hold."""

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


class SerializationError(DdlfError):
    """A value could not be pickled or unpickled (on the master or on a worker)."""


class WorkerStartError(DdlfError):
    """A worker daemon could not start (address in use, bad option, ...)."""


class InsecureConfiguration(WorkerStartError):
    """A daemon was asked to listen on a non-loopback address without a token."""


__all__ = [
    "AuthenticationError",
    "DdlfError",
    "DeadlineExceeded",
    "InsecureConfiguration",
    "NotFoundError",
    "ProtocolError",
    "RemoteError",
    "RequestRejected",
    "SerializationError",
    "WorkerRestarted",
    "WorkerStartError",
    "WorkerUnavailable",
]
