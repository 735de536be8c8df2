"""Gradients exchanged while the backward pass still runs (PyTorch DDP's gradient buckets, Horovod's fusion).

With gradient averaging (:class:`~ddlf.GradientAveraging`)
a step computes all gradients, then averages them over the ring. On PyTorch (Keras
on the torch backend, :class:`ddlf.models.TorchModel`) the gradients of the last layers are ready long before the
backward pass reaches the first ones, so :class:`Buckets` starts averaging them at once: the parameters are cut,
in reverse order (the order backward finishes them), into buckets of about ``bucket_cap_mb``; a hook on each
parameter copies its gradient (times this worker's weight) into its bucket's buffer as soon as autograd has
accumulated it, and a full bucket goes to the ring on a background thread (the Rust ring releases the GIL) while
backward goes on. After backward, what was not sent yet is sent, and the step waits for the last bucket.

Every rank launches the buckets in the same order (bucket ``k`` only after bucket ``k - 1``), whatever order its
hooks fire in, so the ranks' ring passes always pair up. Each bucket carries its own weight as its last element
(as the one-buffer exchange does); a bucket whose gradients are not finite is sent as zeros with weight 0, so a
NaN never reaches the other replicas (with buckets it is left out bucket by bucket: the other buckets of that
batch still count). A model that scales its loss (float16 mixed precision) keeps them instead: its gradient scaler,
the same on every rank, then skips the step everywhere and shrinks the scale.

A gradient on a GPU is scaled there and copied once, into its bucket's host buffer that goes to the ring.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np


def cut(sizes: list[int], cap_bytes: int) -> list[list[int]]:
    """The indices of parameters of ``sizes`` float32 elements, last first (the order backward finishes them),
    cut into buckets that each hold at least ``cap_bytes`` (the last one whatever is left)."""
    members: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        used += sizes[i]
        if used * 4 >= cap_bytes:
            members.append(current)
            current, used = [], 0
    if current:
        members.append(current)
    return members


class Buckets:
    """Bucketed, overlapped gradient exchange for a list of float32 torch parameters (see the module docs)."""

    op = "sum"
    """What the ring does with the buckets (the weighted sums are divided here)."""

    def __init__(self, params: list[Any], cap_bytes: int, keep_nonfinite: bool = False) -> None:
        import torch

        self._torch = torch
        self.keep_nonfinite = keep_nonfinite
        """Send a bucket whose gradients are not finite as it is (a loss scaler decides on the sum)."""
        self.params = params
        self.sizes = [int(p.numel()) for p in params]
        self.bucket_of: list[int] = [0] * len(params)
        self.offset: list[int] = [0] * len(params)
        self.members = cut(self.sizes, cap_bytes)
        for b, m in enumerate(self.members):
            used = 0
            for i in m:
                self.bucket_of[i], self.offset[i] = b, used
                used += self.sizes[i]
        self.lengths = [sum(self.sizes[i] for i in m) for m in self.members]
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ddlf-buckets")
        self._active = False
        self.waited = 0.0
        """Seconds the last step waited for the exchange after its backward pass (what overlap did not hide)."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    @staticmethod
    def supports(params: list[Any]) -> bool:
        """Float32 parameters on a torch with post-accumulate hooks (2.1 and later)."""
        import torch

        return bool(params) and all(
            p.dtype == torch.float32 and hasattr(p, "register_post_accumulate_grad_hook") for p in params
        )

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._pool.shutdown(wait=True)

    # -- one step ----------------------------------------------------------------------------------------------

    def exchange(
        self,
        backward: Callable[[], None] | None,
        weight: float,
        reduce: Callable[[np.ndarray], None],
    ) -> tuple[list[np.ndarray], list[float], bool]:
        """Run ``backward`` (``None``: this rank has no batch this step, it sends zeros with weight 0) while the
        buckets are reduced with ``reduce`` (in place, a sum over the ranks). Returns the averaged gradients (one
        array per parameter, views of the bucket buffers), each bucket's total weight (0: no rank sent any), and
        whether a bucket of this rank's was left out as not finite."""
        self._flats = [np.empty(n + 1, np.float32) for n in self.lengths]
        self._left = [len(m) for m in self.members]
        self._next = 0
        self._weight = np.float32(weight if backward is not None else 0.0)
        self._futures: list[Future[None]] = []
        self._reduce = reduce
        self._bad = False
        self._delivered = [False] * len(self.params)
        self._active = True
        try:
            if backward is not None:
                backward()
            t_wait = time.perf_counter()
            with self._lock:
                for i, done in enumerate(self._delivered):
                    if not done:  # no gradient (unused parameter, or no batch): zeros
                        self._put(i, None)
            error: BaseException | None = None
            for f in self._futures:
                try:
                    f.result()
                except BaseException as exc:  # the first failure is raised below
                    error = error or exc
            self.waited = time.perf_counter() - t_wait
            if error is not None:
                raise error
        finally:
            self._active = False
        totals = []
        for flat in self._flats:
            total = float(flat[-1])
            totals.append(total)
            if total > 0:
                flat[:-1] *= np.float32(1.0 / total)
            else:
                flat[:-1] = 0
        grads = []
        for i, p in enumerate(self.params):
            flat, at = self._flats[self.bucket_of[i]], self.offset[i]
            grads.append(flat[at : at + self.sizes[i]].reshape(tuple(p.shape)))
        return grads, totals, self._bad

    def _hook(self, i: int) -> Callable[[Any], None]:
        def hook(param: Any) -> None:
            if self._active:
                with self._lock:
                    self._put(i, param.grad)

        return hook

    def _put(self, i: int, grad: Any) -> None:
        if self._delivered[i]:
            return
        self._delivered[i] = True
        b, at, n = self.bucket_of[i], self.offset[i], self.sizes[i]
        out = self._flats[b][at : at + n]
        if grad is None or self._weight == 0:
            out[:] = 0
        elif grad.device.type == "cpu":
            np.multiply(grad.detach().reshape(-1).numpy(), self._weight, out=out)
        else:  # scaled on the device, one copy to the host
            self._torch.from_numpy(out).copy_(grad.detach().reshape(-1) * float(self._weight))
        self._left[b] -= 1
        while self._next < len(self.members) and self._left[self._next] == 0:
            flat = self._flats[self._next]
            flat[-1] = self._weight
            if not self.keep_nonfinite and not np.isfinite(flat).all():
                flat[:] = 0  # left out of this bucket's average on every rank
                self._bad = True
            self._futures.append(self._pool.submit(self._reduce, flat))
            self._next += 1
