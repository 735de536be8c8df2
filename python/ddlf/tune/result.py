"""What a sweep returns: one :class:`Trial` per configuration and the :class:`SweepResult` over them."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError
from ..training.history import History


@dataclass
class Trial:
    """One configuration of a sweep and what became of it."""

    index: int
    config: dict[str, Any]
    status: Literal["pending", "running", "completed", "stopped", "failed"] = "pending"
    history: History | None = None
    metric: float | None = None
    """The trial's best value of the sweep's metric (by the sweep's ``mode``)."""
    epochs: int = 0
    workers: list[int] = field(default_factory=list)
    error: BaseException | None = None
    attempts: int = 0
    spans: list[tuple[float, float, list[int]]] = field(default_factory=list)
    """``(start, end, workers)`` of each attempt, in seconds since the sweep started."""

    @property
    def seconds(self) -> float:
        """Time spent training this trial, all attempts together."""
        return sum(end - start for start, end, _ in self.spans)


@dataclass
class SweepResult:
    """Every trial, in config order, and the best one."""

    trials: list[Trial]
    metric: str
    mode: str
    seconds: float

    @property
    def best(self) -> Trial:
        """The trial with the best metric (failed trials never win)."""
        scored = [t for t in self.trials if t.metric is not None and not math.isnan(t.metric)]
        if not scored:
            raise ConfigError("no trial reported the metric")
        pick = max if self.mode == "max" else min
        return pick(scored, key=lambda t: t.metric)  # type: ignore[arg-type,return-value]

    def write_report(self, path: str | os.PathLike[str], *, title: str | None = None) -> Path:
        """Write the sweep's HTML page (best trial, curves, worker-group timeline, trial table) at ``path`` and
        its numbers as JSON beside it; returns the HTML file's path."""
        from ..report.sweep import write_sweep_report

        return write_sweep_report(self, path, title=title)

    def table(self) -> list[dict[str, Any]]:
        """One row per trial: its config, status, epochs trained, metric, seconds and workers."""
        return [
            {
                **t.config,
                "status": t.status,
                "epochs": t.epochs,
                self.metric: t.metric,
                "seconds": round(t.seconds, 2),
                "workers": t.workers,
            }
            for t in self.trials
        ]
