"""Asynchronous successive halving (ASHA): which trials a sweep stops early."""

from __future__ import annotations

import math
import threading

import numpy as np


class _Asha:
    """Asynchronous successive halving: the stop decisions at each rung, shared by all trials (thread-safe)."""

    def __init__(self, epochs: int, grace: int, rf: float, mode: str) -> None:
        self.rungs: list[int] = []
        r = float(grace)
        while r < epochs:
            self.rungs.append(round(r))
            r *= rf
        self.recorded: dict[int, list[float]] = {r: [] for r in self.rungs}
        self.rf, self.sign = rf, (1.0 if mode == "max" else -1.0)
        self.lock = threading.Lock()

    def keep_going(self, epochs_done: int, value: float) -> bool:
        """Record a trial's metric if ``epochs_done`` is a rung; whether it continues. Ray Tune's cut: the trial
        stops when its metric is below the ``1 - 1/rf`` percentile (linear interpolation) of the metrics that
        reached this rung before it; the first to reach a rung continues. Unlike Ray, a metric that is not a
        number stops the trial at once."""
        if math.isnan(value):
            return False
        if epochs_done not in self.recorded:
            return True
        with self.lock:
            seen = self.recorded[epochs_done]
            cut = float(np.percentile(seen, (1 - 1 / self.rf) * 100)) if seen else None
            seen.append(self.sign * value)
            return cut is None or self.sign * value >= cut
