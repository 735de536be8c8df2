"""What ``app.train`` was asked to do, as one object."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .outer import OuterSpec
from .policy import FailurePolicy


@dataclass
class TrainConfig:
    """Everything ``app.train`` was asked to do."""

    epochs: int
    batch_size: int
    seed: int = 0
    averaging_frequency: int | None = None  # batches per round; None = the whole partition (one round per epoch)
    average_optimizer_state: bool = False
    shuffle: str = "indices"  # or "seeded"
    shares: list[float] | None = None
    compression: str | None = None
    topk_ratio: float = 0.01
    prefetch: int = 2
    staleness: str = "none"
    max_staleness: int | None = None
    verbose: int = 1
    slow_worker: tuple[int, float] | None = None  # (worker, seconds per batch): for experiments
    rotate_shards_every: int | None = None
    checkpoint_dir: str | None = None
    resume: bool = False
    rejoin_timeout: float = 60.0  # every worker lost: how long to wait for one to come back
    report: str | None = None  # write an HTML training report there at the end (and its stats as JSON)
    failure_policy: FailurePolicy = field(default_factory=FailurePolicy)  # what a worker's failure does
    workers: list[int] | None = None  # train on these workers of the cluster only (None: all)
    exchange: str | None = "master"  # sync: "master", "allreduce" or "auto" (see training.exchange); None: by averaging
    hierarchical: bool | None = None  # all-reduce: shared memory within a host, the ring between hosts (None: auto)
    nonfinite: str = "skip"  # a reply with NaN/inf: "skip" (leave it out of its round) or "raise"
    averaging: str = "weights"  # sync: "weights" (model averaging) or "gradients" (every step, see training.gradients)
    scale_learning_rate: bool = False  # gradients: learning rate x workers (Goyal et al. 2017)...
    warmup_epochs: float = 0.0  # ...reached linearly over this many epochs
    bucket_cap_mb: float | None = 25.0  # gradients on PyTorch: exchanged in buckets during backward (None: after)
    outer_optimizer: str | None = None  # model averaging: "nesterov" steps with the round's change (training.outer)
    outer_learning_rate: float = 0.7
    outer_momentum: float = 0.9
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    t0: float = field(default_factory=time.perf_counter)  # training start: round start times are relative to it

    def check(self) -> None:
        if self.epochs < 0 or self.batch_size < 1:
            raise ValueError("epochs must be >= 0 and batch_size >= 1")
        if self.shuffle not in ("indices", "seeded"):
            raise ValueError(f"shuffle must be 'indices' or 'seeded', not {self.shuffle!r}")
        if self.compression not in (None, "float16", "bfloat16", "topk"):
            raise ValueError(f"compression must be None, 'float16', 'bfloat16' or 'topk', not {self.compression!r}")
        if not 0 < self.topk_ratio <= 1:
            raise ValueError(f"topk_ratio must be in (0, 1], not {self.topk_ratio}")
        if self.staleness not in ("none", "dynsgd"):
            raise ValueError(f"staleness must be 'none' or 'dynsgd', not {self.staleness!r}")
        if self.rotate_shards_every is not None and self.rotate_shards_every < 1:
            raise ValueError("rotate_shards_every must be at least 1 epoch")
        if not isinstance(self.failure_policy, FailurePolicy):
            raise TypeError(f"failure_policy must be a ddlf.FailurePolicy, not {type(self.failure_policy).__name__}")
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise', not {self.nonfinite!r}")
        if self.hierarchical not in (None, True, False):
            raise ValueError(f"hierarchical must be None, True or False, not {self.hierarchical!r}")
        if self.exchange not in (None, "master", "allreduce", "auto"):
            raise ValueError(f"exchange must be 'master', 'allreduce' or 'auto', not {self.exchange!r}")
        if self.averaging_frequency is not None and self.averaging_frequency < 1:
            raise ValueError("averaging_frequency must be at least 1 batch")
        if self.averaging not in ("weights", "gradients"):
            raise ValueError(f"averaging must be 'weights' or 'gradients', not {self.averaging!r}")
        if not isinstance(self.scale_learning_rate, bool):
            raise TypeError(f"scale_learning_rate must be True or False, not {self.scale_learning_rate!r}")
        if isinstance(self.warmup_epochs, bool) or not (
            isinstance(self.warmup_epochs, (int, float)) and 0 <= self.warmup_epochs < float("inf")
        ):
            raise ValueError(f"warmup_epochs must be a number of epochs >= 0, not {self.warmup_epochs!r}")
        if self.averaging == "gradients":
            if self.compression == "topk":
                raise ValueError(
                    'compression="topk" is for averaging="weights": the ring sums dense gradients; '
                    '"float16" and "bfloat16" halve their bytes'
                )
            if self.average_optimizer_state:
                raise ValueError(
                    'average_optimizer_state is for averaging="weights": with averaging="gradients" every worker '
                    "holds the same optimizer state already"
                )
        elif self.scale_learning_rate or self.warmup_epochs:
            raise ValueError(
                'scale_learning_rate and warmup_epochs are for averaging="gradients" (n workers step like one '
                "process at n times the batch); model averaging keeps each worker's own learning rate"
            )
        cap = self.bucket_cap_mb
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < float("inf")
        ):
            raise ValueError(f"bucket_cap_mb must be a positive number of MB or None, not {cap!r}")
        if self.outer_optimizer is not None:
            self.outer().check()
            if self.averaging != "weights":
                raise ValueError(
                    'outer_optimizer is for averaging="weights": it steps with each round\'s averaged change of the '
                    'weights; with averaging="gradients" every step is averaged already'
                )
        if self.warmup_epochs and not self.scale_learning_rate:
            raise ValueError("warmup_epochs warms up the scaled learning rate: set scale_learning_rate=True too")

    def outer(self) -> OuterSpec:
        """The outer optimizer asked for (``outer_optimizer`` must be set)."""
        return OuterSpec(str(self.outer_optimizer), self.outer_learning_rate, self.outer_momentum)

    def learning_rate_factor(self, workers: int, progress: float) -> float:
        """The learning rate's multiple ``progress`` epochs into training: ``workers`` with
        ``scale_learning_rate``, reached linearly from 1 over ``warmup_epochs``; 1 otherwise."""
        if not self.scale_learning_rate:
            return 1.0
        if self.warmup_epochs <= 0:
            return float(workers)
        return 1.0 + (workers - 1) * min(1.0, max(0.0, progress) / self.warmup_epochs)
