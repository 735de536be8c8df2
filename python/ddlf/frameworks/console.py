"""Frameworks' start-up notices kept off the user's console.

TensorFlow writes its C++ start-up notices straight to file descriptor 2 while it imports: absl's ``WARNING: All
log messages before absl::InitializeLog() is called are written to STDERR``, oneDNN's ``oneDNN custom operations
are on ...`` (twice: no environment variable silences it short of turning oneDNN off) and cpu_feature_guard's
``This TensorFlow binary is optimized ...``: 6 lines per process, in the master and in every worker. Python
cannot filter what C++ writes, so where ddlf loads a framework (the seeding that every run does, a daemon's
preload, a worker unpickling an app) it does so inside :func:`quiet_start`: fd 2 points to a temporary file
meanwhile; afterwards whatever is not such a notice (a warning, a traceback, an error-level line, a user's print)
is written to the real stderr, in order, and the notices go to the ``ddlf.frameworks`` logger at INFO: on a worker
that is the daemon's log (``ddlf logs HOST:PORT``, ``cluster.logs(worker)``), in the master wherever the user's
``logging`` sends INFO (by default nowhere).

``DDLF_LOG=debug`` (or ``trace``, or any directive naming them) leaves stderr alone everywhere (a
``Cluster.local``'s daemons inherit it): the notices print as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import IO

log = logging.getLogger("ddlf.frameworks")

_GLOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^ :\]]+:\d+\] ")
"""A line of absl's or glog's log format (TensorFlow, XLA): level letter, date, time, thread, file:line]."""
_NOTICE = re.compile(rb"^[IW]")
"""Of those, the levels that are notices (INFO, WARNING); ERROR and FATAL lines always reach stderr."""
_ABSL_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_CONTINUATION = re.compile(rb"^To enable the following instructions: ")
"""The continuation lines of multi-line notices (cpu_feature_guard's second line). Only known ones: anything else
after a notice (a user's print, say) could not be told from one, and reaches stderr."""


def framework_logs_shown() -> bool:
    """Whether frameworks' start-up notices go to stderr as the frameworks write them: ``DDLF_LOG`` asks for
    debug or trace lines."""
    wanted = os.environ.get("DDLF_LOG", "").lower()
    return "debug" in wanted or "trace" in wanted


def split_notices(data: bytes) -> tuple[bytes, list[str]]:
    """``data`` (what was written to stderr) without the frameworks' start-up notices, and those notices' lines.

    A notice is a line of absl's format at INFO or WARNING level, absl's preamble, or a known continuation line
    right after one (cpu_feature_guard's second line)."""
    kept: list[bytes] = []
    notices: list[str] = []
    in_notice = False
    for line in data.splitlines(keepends=True):
        text = line.rstrip(b"\r\n")
        if _GLOG.match(text):
            in_notice = bool(_NOTICE.match(text))
        elif text == _ABSL_PREAMBLE:
            in_notice = True
        elif in_notice and _CONTINUATION.match(text):
            pass  # the notice goes on
        else:
            in_notice = False
        if in_notice:
            notices.append(text.decode("utf-8", "replace"))
        else:
            kept.append(line)
    return b"".join(kept), notices


class _Capture:
    """fd 2 pointed at a temporary file while any thread is inside :func:`quiet_start` (counted: the daemon's
    preload and a request may both load frameworks; stderr comes back when the last one is done)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved: int | None = None
        self.file: IO[bytes] | None = None

    def begin(self) -> None:
        with self.lock:
            self.depth += 1
            if self.depth > 1:
                return
            _flush_python_streams()
            try:
                file = tempfile.TemporaryFile()  # noqa: SIM115 (closed in end)
            except OSError:
                return
            try:
                saved = os.dup(2)
            except OSError:  # no stderr at all: nothing to keep quiet
                file.close()
                return
            os.dup2(file.fileno(), 2)
            self.saved, self.file = saved, file

    def end(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth or self.saved is None or self.file is None:
                return
            _flush_python_streams()
            os.dup2(self.saved, 2)
            os.close(self.saved)
            file, self.saved, self.file = self.file, None, None
            file.seek(0)
            data = file.read()
            file.close()
            kept, notices = split_notices(data)
            _write_all(2, kept)
        for line in notices:
            log.info("%s", line)


_CAPTURE = _Capture()


@contextlib.contextmanager
def quiet_start() -> Iterator[None]:
    """Run the block (a framework's import) with its start-up notices kept off stderr (see the module's
    docstring); everything else written to stderr meanwhile comes out when the block ends."""
    if framework_logs_shown():
        yield
        return
    _CAPTURE.begin()
    try:
        yield
    finally:
        _CAPTURE.end()


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a stream replaced by something without flush, or closed
            stream.flush()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError:  # stderr closed: nowhere to write
            return
