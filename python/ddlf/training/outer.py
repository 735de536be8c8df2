"""The outer optimizer of model averaging (DiLoCo, Douillard et al. 2023): instead of replacing the weights with the
round's average, treat ``start - average`` as a gradient and step with Nesterov momentum.

    g      = start - average                 (the outer gradient of the round)
    m      = momentum * m + g
    new    = start - learning_rate * (g + momentum * m)

With ``learning_rate=1`` and ``momentum=0`` this is plain averaging. DiLoCo's values (0.7, 0.9) let workers average
far less often (hundreds of steps) at equal quality. Only trained float weights take the step; the rest (BatchNorm
statistics, integer counters) take the average as they would without it.

Both exchanges use it: the master applies it to the merged weights (:class:`~ddlf.ThroughMaster`); with the ring every
member applies it to the same average with the same momentum, so the replicas stay bit-identical. The momentum is
part of the run's state: saved in checkpoints (master exchange), adopted by a member that joins the ring, and
rewound with the weights when a round is redone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, ModelMismatchError

NAMES = ("nesterov",)


@dataclass
class OuterSpec:
    """The outer optimizer as the workers receive it (from :class:`ddlf.Nesterov`)."""

    name: str = "nesterov"
    learning_rate: float = 0.7
    momentum: float = 0.9

    def check(self) -> None:
        if self.name not in NAMES:
            raise ConfigError(f"the outer optimizer must be one of {NAMES}, not {self.name!r}")
        lr, mu = self.learning_rate, self.momentum
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
            raise ConfigError(f"Nesterov.learning_rate must be a finite number > 0, not {lr!r}")
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not 0 <= mu < 1:
            raise ConfigError(f"Nesterov.momentum must be a number in [0, 1), not {mu!r}")


@dataclass
class OuterMomentum:
    """The outer step and its momentum buffers (one per weight; None until the first step)."""

    spec: OuterSpec
    momentum: list[np.ndarray] | None = None

    def ensure(self, average: list[np.ndarray], trained: list[bool]) -> list[np.ndarray]:
        """The momentum buffers, made (zeros) on first use: shaped like the weights that take the step, empty for
        the others, so that every member of a ring holds buffers of the same shapes."""
        if self.momentum is None:
            takes = _takes(average, trained)
            self.momentum = [np.zeros_like(a) if t else np.zeros(0, a.dtype) for a, t in zip(average, takes)]
        return self.momentum

    def step(self, start: list[np.ndarray], average: list[np.ndarray], trained: list[bool]) -> list[np.ndarray]:
        """The new weights from the round's ``start`` and ``average`` (same shapes); updates the momentum."""
        if len(start) != len(average) or len(trained) != len(start):
            raise ModelMismatchError(
                f"outer step: {len(start)} start weights, {len(average)} averaged, {len(trained)} flags"
            )
        takes = _takes(average, trained)
        self.ensure(average, trained)
        assert self.momentum is not None
        lr = np.float64(self.spec.learning_rate)
        mu = np.float64(self.spec.momentum)
        out = []
        for i, (s, a, t) in enumerate(zip(start, average, takes)):
            if not t:
                out.append(a)
                continue
            dtype = a.dtype
            g = np.subtract(s, a, dtype=dtype)
            m = self.momentum[i]
            m *= dtype.type(mu)
            m += g
            update = g + dtype.type(mu) * m
            out.append(np.subtract(s, dtype.type(lr) * update, dtype=dtype))
        return out

    def state(self) -> list[np.ndarray] | None:
        """The momentum buffers (copies), for a checkpoint or a redo."""
        return None if self.momentum is None else [m.copy() for m in self.momentum]

    def load(self, state: list[np.ndarray] | None) -> None:
        self.momentum = None if state is None else [np.array(m) for m in state]


def _takes(weights: list[np.ndarray], trained: list[bool]) -> list[bool]:
    return [bool(t) and np.asarray(a).dtype.kind == "f" for t, a in zip(trained, weights)]
