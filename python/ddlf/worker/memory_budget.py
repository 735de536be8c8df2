"""A worker's memory budget (``ddlf-worker --max-memory SIZE``): what the daemon refuses so that it keeps serving.

The budget is on the worker process's resident memory (what ``ddlf status`` shows as ``rss``: the interpreter,
the frameworks it loaded, variables, datasets, models). It is enforced three ways, each leaving nothing behind:

* **before** a request that stores or runs something (``set``, a call, ``put_dataset``/``load_dataset``, exec,
  uploads) is decoded: its bytes are in memory already (the network side received them), so resident memory
  then, plus the size of its pickle (unpickling builds objects about that large; arrays are decoded in place, no
  copy), past the budget, and the request is refused;
* **after** a ``set`` or a dataset load: the value turned out larger than its bytes on the wire (a decoded or
  computed dataset), so it is dropped again and the request refused;
* **during** a call: a watchdog thread samples resident memory every few milliseconds and, past the budget,
  raises :class:`~ddlf.errors.MemoryBudgetExceeded` inside the call (between two Python bytecodes: a single C
  allocation that is larger than what is left cannot be stopped half-way, and the kernel may stop the process
  first when the budget is above what the machine has). The call's frames unwind and free what they held.

The master receives :class:`~ddlf.errors.MemoryBudgetExceeded` (a ``RequestRejected`` and a ``MemoryError``).
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import threading
import time
from typing import Any

from ..errors import ConfigError, MemoryBudgetExceeded
from ..process import return_free_memory

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_UNITS.update({"ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4})
WATCH_INTERVAL = 0.005
"""Seconds between two samples of resident memory while a call runs."""


def parse_size(text: str) -> int:
    """``"512M"``, ``"2G"``, ``"1.5GiB"``, ``"1000000"`` -> bytes (K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti of
    1024; a trailing ``B`` is optional). Raises :class:`~ddlf.errors.ConfigError` for anything else, zero or
    negative sizes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ConfigError(f"not a size: {text!r} (use bytes, or a number with K, M, G, T, Ki, Mi, Gi or Ti)")
    size = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if size <= 0:
        raise ConfigError(f"a memory budget must be positive, not {text!r}")
    return size


def resident_bytes() -> int:
    """This process's resident memory now (Linux: ``/proc/self/statm``; elsewhere the peak, from rusage)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


class MemoryBudget:
    """The budget of one worker process, or none (``limit=None``: nothing is checked, nothing is sampled)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._guarded: int | None = None  # the thread id whose call the watchdog may interrupt
        self._tripped = False
        self._wake = threading.Event()
        if limit is not None:
            threading.Thread(target=self._watch, name="ddlf-memory-budget", daemon=True).start()

    def check(self, decoding: int, what: str) -> None:
        """Refuse ``what`` when resident memory (the received request included) plus ``decoding`` bytes (what
        decoding it will build) would pass the budget."""
        if self.limit is None:
            return
        rss = resident_bytes()
        if rss + decoding > self.limit:
            raise MemoryBudgetExceeded(
                f"{what} refused: with it this worker would hold {_mib(rss + decoding)}, over its memory budget "
                f"of {_mib(self.limit)} (--max-memory); it was not kept. Delete variables or datasets there, or "
                "start the worker with a larger budget"
            )

    def check_after(self, what: str) -> None:
        """Refuse ``what`` when resident memory is past the budget now (the caller drops what it stored)."""
        if self.limit is None:
            return
        rss = resident_bytes()
        if rss > self.limit:
            raise MemoryBudgetExceeded(
                f"{what} refused: with it this worker would hold {_mib(rss)}, over its memory budget of "
                f"{_mib(self.limit)} (--max-memory); it was not kept"
            )

    def release(self) -> None:
        """Give memory freed by a refused request back to the system: collect cycles, then ask the C allocator
        to return its free pages (glibc's ``malloc_trim``; elsewhere a no-op). Without it the freed arrays stay in
        the allocator's heap and resident memory stays near the budget after the refusal."""
        gc.collect()
        return_free_memory()

    # -- a call under watch ------------------------------------------------------------------------------------

    def __enter__(self) -> MemoryBudget:
        if self.limit is not None:
            with self._lock:
                self._guarded = threading.get_ident()
                self._tripped = False
            self._wake.set()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.limit is None:
            return
        with self._lock:
            ident, self._guarded = self._guarded, None
            tripped = self._tripped
        if tripped and ident is not None:
            # An exception set just as the call returned must not surface in the daemon's own code.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)

    def _watch(self) -> None:
        assert self.limit is not None
        while True:
            self._wake.wait()
            while True:
                with self._lock:
                    ident = self._guarded
                    if ident is None:
                        self._wake.clear()
                        break
                    if not self._tripped and resident_bytes() > self.limit:
                        self._tripped = True
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(ident), ctypes.py_object(_WatchdogExceeded)
                        )
                time.sleep(WATCH_INTERVAL)


class _WatchdogExceeded(MemoryBudgetExceeded):
    """Raised inside a call by the watchdog (an async exception is raised by class, without a message)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(
            args[0]
            if args
            else "the call was stopped: this worker's resident memory passed its memory budget (--max-memory) "
            "while it ran; what it allocated was freed",
            **kwargs,
        )
