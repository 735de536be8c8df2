"""What a worker's failure does to a training run: :class:`FailurePolicy`, part of every run's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError, RemoteError, WorkerUnavailable


@dataclass(frozen=True)
class FailurePolicy:
    """What a worker's failure does to a training run (in the spirit of Ray Train v2's ``FailurePolicy``).

    ``lost_worker``: a worker that is lost (killed, stopped, cut off; :class:`~ddlf.errors.WorkerUnavailable`), or
    going away (told to stop with SIGTERM: it refuses new work while it drains, :mod:`ddlf.worker.drain`):
    ``"continue"`` leaves it out (sync: the round is re-weighted over the survivors; async: its chunk goes back
    to the queue) and takes it back when it returns; ``"raise"`` stops training with its error.
    ``remote_error``: user code raised on a worker (or any other error): ``"raise"`` stops training (the default:
    a bug does not fix itself); ``"continue"`` leaves that worker's result out of the round.
    """

    lost_worker: Literal["continue", "raise"] = "continue"
    remote_error: Literal["continue", "raise"] = "raise"

    def __post_init__(self) -> None:
        for what in ("lost_worker", "remote_error"):
            if getattr(self, what) not in ("continue", "raise"):
                raise ConfigError(f"{what} must be 'continue' or 'raise', not {getattr(self, what)!r}")

    def decide(self, exc: BaseException) -> Literal["continue", "raise"]:
        """What to do about a worker's failure ``exc``."""
        if isinstance(exc, WorkerUnavailable) or stopping(exc):
            return self.lost_worker
        return self.remote_error


def stopping(exc: BaseException) -> bool:
    """Whether ``exc`` is a worker's answer that it is stopping (SIGTERM): it abandoned the call and takes no new
    work, but still answers for a while (:mod:`ddlf.worker.drain`)."""
    return isinstance(exc, RemoteError) and exc.raised("WorkerStopping")
