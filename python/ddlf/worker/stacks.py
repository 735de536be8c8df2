"""Every thread's Python stack on request (``ddlf stacks``, ``Cluster.stacks()``), even from a stuck interpreter.

Python's :mod:`faulthandler` is registered on a real-time signal, appending every thread's stack to a private
file; the daemon's network side (``rust/ddlf-worker/src/stacks.rs``) opens the file too, after which its name is
removed (a killed daemon leaves nothing behind in the temporary directory). To take the stacks it empties the file,
raises the signal on one of its own threads and reads the text back. faulthandler's handler is C code that walks the
frames without the GIL, so a worker whose interpreter thread is deep in a computation, or deadlocked, answers within
milliseconds.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import tempfile
from typing import IO, Any

#: The signal the daemon raises to take the stacks: a real-time one, which nothing else in a worker uses (Slurm's
#: ``--signal`` and users' own handlers take SIGUSR1/SIGUSR2).
STACK_SIGNAL = signal.SIGRTMIN + 6


class StackDumps:
    """The registration and its file, kept for the daemon's life; :meth:`close` undoes both."""

    def __init__(self, daemon: Any) -> None:
        fd, path = tempfile.mkstemp(prefix="ddlf-stacks-", suffix=".txt")  # mode 0600: the user's only
        os.close(fd)
        self._file: IO[str] | None = open(path, "a")  # noqa: SIM115 - appending: see the module docstring
        faulthandler.register(STACK_SIGNAL, file=self._file, all_threads=True, chain=False)
        try:
            daemon.set_stack_dumper(int(STACK_SIGNAL), path)
        except BaseException:
            self.close()
            raise
        finally:
            # Both sides hold the file open now: its name is not needed, and would outlive a killed daemon.
            with contextlib.suppress(OSError):
                os.unlink(path)

    def close(self) -> None:
        """Unregister and close the file."""
        if self._file is None:
            return
        faulthandler.unregister(STACK_SIGNAL)
        self._file.close()
        self._file = None
