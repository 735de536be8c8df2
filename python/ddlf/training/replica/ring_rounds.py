"""Rounds on the ring: the workers average weights (model averaging) or gradients (every step) among themselves."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import ops
from ...errors import NotFoundError
from ...frameworks.adapter import adapter_for
from ...ring_spec import RingSpec
from ...worker import drain, reduction
from ...worker.reduction import BucketRing, reduce_scratch
from ..messages import GradientRound, MasterRound, RingRound, finite, weights_var
from ..outer import OuterMomentum, OuterSpec
from .rounds import train_chunk
from .state import (
    optimizer_built,
    optimizer_state,
    optimizer_state_bytes,
    rng_state,
    set_optimizer_state,
    set_rng_state,
    take_round_rates,
)
from .steppers import local_mask

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("ddlf.training")


def _start_weights(worker: Any, session: Session, run_id: str, round_no: int, fresh: bool) -> list[np.ndarray]:
    """Where an all-reduce round starts: the master's broadcast (``fresh``: a new member), the weights before
    this round (a redo after a failed all-reduce), or the result of the last round reduced here."""
    if fresh:
        return list(worker.vars[weights_var(run_id)])
    reduced = session.reduced
    if reduced is None or reduced[0] not in (round_no, round_no - 1):
        have = "none" if reduced is None else f"round {reduced[0]}"
        raise NotFoundError(f"run {run_id}: no reduced weights for round {round_no} here (have {have})")
    return reduced[1] if reduced[0] == round_no else reduced[2]


def _reduce_floats(
    arrays: list[np.ndarray], samples: float, spec: RingSpec, wire: str | None = None, unit: float = 1.0
) -> list[np.ndarray]:
    """The samples-weighted average over the ring's ranks of every float array: ``sum(samples_i * a_i) /
    sum(samples_i)``. Per float dtype, the arrays are scaled straight into one buffer (the only copy), with the
    sample count as its last element, reduced where it lies, and divided in place; the results are views of it.
    Other arrays (integer step counters) stay as they are here. See :func:`_weighted_mean` for ``wire``."""
    return _weighted_mean(arrays, samples, spec, wire, unit)[0]


def _weighted_mean(
    arrays: list[np.ndarray], samples: float, spec: RingSpec, wire: str | None = None, unit: float = 1.0
) -> tuple[list[np.ndarray], float]:
    """:func:`_reduce_floats`, and the ranks' total of ``samples`` (0: no rank had any, and the arrays are
    returned as they were).

    ``wire="float16"|"bfloat16"``: float32 arrays travel at half precision (sums in float32). The weights are then
    ``samples / unit`` (``unit``: the same on every rank, so that a weight is about 1 and a weighted value stays as
    small as the value itself: float16 ends at 65504)."""

    half = [i for i, a in enumerate(arrays) if ops.is_half(a)]
    if half:  # averaged in float32, returned in their own dtype
        wide, total = _weighted_mean(
            [np.asarray(a, np.float32) if i in half else a for i, a in enumerate(arrays)], samples, spec, wire, unit
        )
        return [w.astype(arrays[i].dtype) if i in half else w for i, w in enumerate(wide)], total
    out = list(arrays)
    total = 0.0
    weight = samples / unit
    for kind in (np.float32, np.float64):
        idx = [i for i, a in enumerate(arrays) if a.dtype == kind]
        if not idx:
            continue
        sizes = [arrays[i].size for i in idx]
        # A new buffer at every call, never a reused one: the results are views of it, and Keras on JAX keeps a
        # 64-byte-aligned array's memory as a variable's value (no copy), so a reused buffer would be rewritten
        # under the model's weights by the next reduction.
        flat = np.empty(sum(sizes) + 1, dtype=kind)
        views, at = [], 0
        for i, n in zip(idx, sizes):
            view = flat[at : at + n].reshape(arrays[i].shape)
            np.multiply(arrays[i], kind(weight), out=view)
            views.append(view)
            at += n
        flat[-1] = weight
        reduce_scratch(flat, spec, "sum", wire=wire if kind == np.float32 else None)
        total = float(flat[-1]) * unit
        if total <= 0:
            return list(arrays), 0.0  # no rank trained a row: nothing to average
        flat[:-1] *= kind(1.0 / flat[-1])
        for i, view in zip(idx, views):
            out[i] = view
    return out, total


def _sum_counter_changes(start: list[np.ndarray], new: list[np.ndarray], out: list[np.ndarray], spec: RingSpec) -> None:
    """In place: each integer array of ``out`` (a counter a layer keeps) becomes ``start`` plus every member's
    change (``new - start``) summed over the ring (in float64: exact below 2**53), as one process counts every
    step. Every member has the same arrays, so all of them call the ring or none."""
    idx = [i for i, s in enumerate(start) if ops.is_counter(s)]
    if not idx:
        return
    flat = np.concatenate([np.ravel(np.asarray(new[i], np.float64) - np.asarray(start[i], np.float64)) for i in idx])
    reduce_scratch(flat, spec, "sum")
    at = 0
    for i in idx:
        s = np.asarray(start[i])
        out[i] = (s + np.rint(flat[at : at + s.size]).reshape(s.shape)).astype(s.dtype)
        at += s.size


def train_reduce(session: Session, worker: Any, spec: RingRound) -> dict[str, Any]:
    """One synchronous round on the ring (:class:`~ddlf.Ring`): train the rows, then average the weights (weighted by
    the samples each trained) with the round's other workers over the ring, worker to worker. Returns samples,
    logs and timings, never the weights. A failed all-reduce raises ``CollectiveError`` and leaves this worker
    able to redo the round from the weights it started it with.

    ``compression="float16"|"bfloat16"``: the ring averages the float32 *changes* of the round (small values,
    half precision on the wire, sums in float32), weighted by samples over ``round_rows`` (the rows of the whole
    round), and every member adds the same average to the same start. Weights that are not finite after training
    are left out of the average (weight 0) and reported (``nonfinite_weights``).

    ``outer``: ``(name, learning_rate, momentum)`` of the outer optimizer (:mod:`.outer`), applied by every member
    to the same average with the same momentum; ``adopt_outer``: some members are new and first take the momentum
    of the ``"others"`` (the members that are not new), or, all being new, of ``"any"`` member that holds one
    (restored from a checkpoint). A redo of the round starts again from the momentum this worker started it with."""

    run_id, round_no, fresh, ring, outer = spec.run_id, spec.round_no, spec.fresh, spec.ring, spec.outer
    compression, adopt_outer = spec.compression, spec.adopt_outer
    redo = not fresh and session.reduced is not None and session.reduced[0] == round_no
    start = _start_weights(worker, session, run_id, round_no, fresh)
    held = session.outer is not None and session.outer.momentum is not None
    if outer is not None:
        if session.outer is None:
            session.outer = OuterMomentum(OuterSpec(*outer))
        session.outer.spec = OuterSpec(*outer)
        if redo:
            session.outer.load(session.outer_start)
        session.outer_start = session.outer.state()
    own = MasterRound(
        run_id=run_id,
        rows=spec.rows,
        batch_size=spec.batch_size,
        prefetch=spec.prefetch,
        slow_seconds_per_batch=spec.slow_seconds_per_batch,
        learning_rate=spec.learning_rate,
        optimizer_groups=spec.optimizer_groups,
        weights=start,
    )
    result = train_chunk(session, worker, own)
    new = [np.asarray(w) for w in result.pop("weights")]
    samples = int(result["samples"])
    weight = float(samples)
    if not all(finite(w) for w in new):
        # Averaged in, NaN would reach every member: this worker's round is left out.
        log.warning("run %s: non-finite weights after round %d: left out of the average", run_id, round_no)
        new, weight = [np.array(w) for w in start], 0.0
        result["nonfinite_weights"] = True
    if compression is None:
        averaged = _reduce_floats(new, weight, ring)
    else:
        halves = [a.dtype == np.float32 for a in new]
        moved = [np.subtract(a, s) if h else a for a, s, h in zip(new, start, halves)]
        mean = _reduce_floats(moved, weight, ring, wire=compression, unit=max(1, spec.round_rows))
        averaged = [np.add(s, m) if h else m for s, m, h in zip(start, mean, halves)]
        if not all(finite(a) for a in averaged):
            # float16 overflowed on the wire (identically on every member): the round's change is dropped.
            log.warning("run %s: round %d's average overflowed %s: not applied", run_id, round_no, compression)
            averaged = list(start)
            result["wire_overflow_steps"] = 1
    _sum_counter_changes(start, new, averaged, ring)
    model = session.model
    if session.outer is not None and outer is not None:
        trained = [not m for m in local_mask(model)]
        momentum = session.outer.ensure(averaged, trained)
        if adopt_outer is not None:
            holder = held if adopt_outer == "any" else not fresh
            session.outer.load(_adopt(momentum, holder, ring))
        averaged = session.outer.step(start, averaged, trained)
    if spec.average_optimizer_state and optimizer_built(model):
        # At full precision: Adam's second moments underflow float16 (and a zero there makes a huge step).
        set_optimizer_state(model, _reduce_floats(optimizer_state(model), weight, ring))
    # The model takes the averaged weights when the next round starts from them (train_chunk sets them).
    drain.call_settled()  # the round ends here: a stop (SIGTERM) from now on lets its reply go out
    session.reduced = (round_no, start, averaged)
    session.last_used = time.monotonic()
    return result


def _adopt(state: list[np.ndarray], holder: bool, spec: RingSpec) -> list[np.ndarray]:
    """The optimizer state of the ring's holders (who all hold the same), for every member: a new member (not a
    holder) takes it. Integer arrays (step counters) travel as float64, exactly."""
    wide = [a.astype(np.float64) if a.dtype.kind in "iub" else np.asarray(a) for a in state]
    mean, total = _weighted_mean(wide, 1.0 if holder else 0.0, spec)
    if total <= 0:
        return state
    return [np.rint(m).astype(a.dtype) if a.dtype.kind in "iub" else m for m, a in zip(mean, state)]


def _warm_up(
    stepper: Any, learning_rate_factor: tuple[float, float] | None, step: int, steps: int, factor: float | None
) -> float | None:
    """Step ``step`` of ``steps`` of a linear warm-up from ``first`` to ``last`` times the compiled learning rate
    (``learning_rate_factor``; None: none): sets the stepper's rate when it changes from ``factor`` (the one set
    last), and returns the one set now."""
    if learning_rate_factor is None:
        return factor
    first, last = learning_rate_factor
    f = first + (last - first) * step / max(1, steps - 1)
    if f != factor:
        stepper.set_learning_rate_factor(f)
    return f


def _alone(
    stepper: Any, batches: Any, steps: int, learning_rate_factor: tuple[float, float] | None, slow: float
) -> None:
    """A ring of one: nothing to average, so the model takes whole steps with its own ``train_step`` (a custom
    one included), exactly as ``fit`` steps; the learning-rate warm-up as on a ring."""
    factor = None
    for step in range(steps):
        batch = next(batches, None)
        if batch is None:
            return
        factor = _warm_up(stepper, learning_rate_factor, step, steps, factor)
        bx, by, sw, _n = batch
        stepper.step(bx, by, sw)
        if slow:
            time.sleep(slow)


def train_gradients(session: Session, worker: Any, spec: GradientRound) -> dict[str, Any]:
    """One synchronous round of :class:`~ddlf.GradientAveraging`: ``steps`` optimizer steps in lockstep with the ring's
    other workers. Each step this worker computes the gradients of its next batch, the ring averages them (weighted
    by each batch's rows; a worker out of batches adds zeros with weight 0), and every worker applies the same
    average with the same optimizer state, so the replicas stay identical. At the end the untrained weights
    (BatchNorm statistics) are averaged too.

    ``adopt``: some members are new (``fresh``): first every member takes the optimizer state of the others.
    ``learning_rate_factor``: ``(first, last)`` multiples of the compiled learning rate, interpolated over the
    steps (the linear warm-up). ``compression="float16"|"bfloat16"``: float32 gradients travel at half precision
    (each weighted by its batch's share of ``batch_size``, so a weighted gradient is no larger than the gradient);
    a step whose average overflowed float16 is skipped on every member alike (``wire_overflow_steps``). A redo of
    a failed round starts again from the weights and optimizer state this worker started it with.
    ``bucket_cap_mb``: where the backend allows (PyTorch: :mod:`.buckets`; TensorFlow: :mod:`.graph_buckets`),
    exchange the gradients in buckets of about this size while the backward pass runs; ``None``: in one buffer
    after it. Returns samples, logs and
    timings (``reduce_seconds``: the time steps waited for the exchange after their backward), never the
    weights."""

    run_id, round_no, fresh, ring, steps = spec.run_id, spec.round_no, spec.fresh, spec.ring, spec.steps
    compression, batch_size, slow_seconds_per_batch = spec.compression, spec.batch_size, spec.slow_seconds_per_batch
    learning_rate_factor, bucket_cap_mb = spec.learning_rate_factor, spec.bucket_cap_mb
    # A redo: this round ran here before (ended, or failed part-way) and starts again from its start states.
    redo = not fresh and (
        (session.reduced is not None and session.reduced[0] == round_no) or session.in_flight == round_no
    )
    start = _start_weights(worker, session, run_id, round_no, fresh)
    model = session.model
    stepper = session.steps()
    t0 = time.perf_counter()
    feed = session.feed(spec.rows, batch_size, spec.prefetch)
    model.set_weights(start)
    if redo and session.rng_start is not None:
        set_rng_state(model, session.rng_start)
    if spec.shard is not None:
        return _train_sharded(session, spec, start, t0, feed)
    if redo and session.optimizer_start is not None:
        set_optimizer_state(model, session.optimizer_start)
    if spec.adopt:
        stepper.build_optimizer()
        adapter = adapter_for(model)
        layout = adapter.optimizer_layout()
        if layout is not None:  # torch: first hold a state for the parameters the others do (the same shape)
            adapter.conform_optimizer(_adopt([layout], not fresh, ring)[0])
        set_optimizer_state(model, _adopt(optimizer_state(model), not fresh, ring))
    session.optimizer_start = optimizer_state(model) if optimizer_built(model) else None
    session.rng_start = rng_state(model)
    session.in_flight = round_no  # until _end_round: a checkpoint meanwhile takes these starting states
    take_round_rates(model, stepper, spec)
    model.reset_metrics()
    stepper.begin()
    batches = iter(feed)
    factor = None
    reduce_s = 0.0
    nonfinite = overflowed = 0
    buckets = stepper.buckets(int(bucket_cap_mb * 2**20), compression) if bucket_cap_mb else None
    # The buckets' reductions on this round's ring (PyTorch's in place, TensorFlow's out of place).
    reduce = BucketRing(ring, buckets.op, compression) if buckets is not None else None

    members = ring.local.total if ring.local is not None else len(ring.addresses)
    try:
        for step in range(steps if members > 1 else 0):
            factor = _warm_up(stepper, learning_rate_factor, step, steps, factor)
            batch = next(batches, None)
            if buckets is not None:
                # The buckets go to the ring while backward runs (on TensorFlow: with a second inter-op thread, see
                # graph_buckets); only the wait after backward counts.
                run, n = None, 0
                if batch is not None:
                    bx, by, sw, n = batch

                    def run(bx: Any = bx, by: Any = by, sw: Any = sw) -> None:
                        stepper.backward(bx, by, sw)
                        if slow_seconds_per_batch:
                            time.sleep(slow_seconds_per_batch)

                averaged, totals, bad = buckets.exchange(run, n / batch_size, reduce)
                reduce_s += buckets.waited
                total = max(totals) * batch_size  # only its sign is read: > 0 when some rank had rows
                if bad:
                    log.warning("run %s: non-finite gradients on a batch of %d rows: left out of the step", run_id, n)
                    nonfinite += 1
            elif batch is None:
                grads, n = stepper.zeros(), 0
            else:
                bx, by, sw, n = batch
                grads = stepper.gradients(bx, by, sw)
                if slow_seconds_per_batch:
                    time.sleep(slow_seconds_per_batch)
                if not stepper.scaled and not all(finite(g) for g in grads):
                    # Averaged in, NaN would reach every replica: this batch is left out of the step.
                    log.warning("run %s: non-finite gradients on a batch of %d rows: left out of the step", run_id, n)
                    grads, n = stepper.zeros(), 0
                    nonfinite += 1
            if buckets is None:
                t_reduce = time.perf_counter()
                averaged, total = _weighted_mean(grads, float(n), ring, wire=compression, unit=batch_size)
                reduce_s += time.perf_counter() - t_reduce
            if averaged is None:
                continue  # the exchange took the optimizer's step itself (TensorFlow: in the step's graph)
            if compression is not None and total > 0 and not stepper.scaled and not all(finite(a) for a in averaged):
                overflowed += 1  # the same bits on every member: all skip this step
                continue
            if total > 0:
                stepper.apply(averaged)
        if members == 1:
            _alone(stepper, batches, steps, learning_rate_factor, slow_seconds_per_batch)
    finally:
        logs = stepper.end()
    state_bytes = optimizer_state_bytes(model) if optimizer_built(model) else 0
    return _end_round(session, spec, start, t0, feed, logs, reduce_s, nonfinite, overflowed, state_bytes)


def _end_round(
    session: Session,
    spec: GradientRound,
    start: list[np.ndarray],
    t0: float,
    feed: Any,
    logs: dict[str, float],
    reduce_s: float,
    nonfinite: int,
    overflowed: int,
    state_bytes: int,
) -> dict[str, Any]:
    """A gradient-averaging round's end: the untrained weights averaged, the counters summed, the result kept for
    the next round, and the reply."""
    model, ring = session.model, spec.ring
    stats = feed.stats()
    samples = int(stats["rows"])
    new = [np.asarray(w) for w in model.get_weights()]  # a 0-d weight may come back as a numpy scalar
    untrained = [i for i, m in enumerate(local_mask(model)) if m]
    if untrained:
        averaged = _reduce_floats([np.asarray(new[i]) for i in untrained], samples, ring)
        for i, a in zip(untrained, averaged):
            new[i] = a
    _sum_counter_changes(start, new, new, ring)
    drain.call_settled()  # the round ends here: a stop (SIGTERM) from now on lets its reply go out
    session.reduced = (spec.round_no, start, new)
    session.in_flight = None
    session.last_used = time.monotonic()
    return {
        "samples": samples,
        "logs": logs,
        "compute_seconds": time.perf_counter() - t0,
        "data_wait_seconds": float(stats["wait_seconds"]),
        "reduce_seconds": reduce_s,
        "steps": spec.steps,
        "nonfinite_batches": nonfinite,
        "wire_overflow_steps": overflowed,
        "optimizer_state_bytes": int(state_bytes),
        "resident_bytes": resident_bytes(),
    }


def resident_bytes() -> int:
    """This process's resident memory now (0 where ``/proc`` does not say)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _train_sharded(session: Session, spec: GradientRound, start: list[np.ndarray], t0: float, feed: Any) -> dict:
    """:func:`train_gradients` with sharded optimizer state (:mod:`.sharded`): the same lockstep of steps, each
    reduce-scattering the gradients, stepping this rank's shard and all-gathering the weights."""
    model, wire, batch_size = session.model, spec.compression, spec.batch_size
    sharded = session.shards()
    stepper = session.steps()
    index = {id(w): i for i, w in enumerate(model.weights)}
    trainable = [np.asarray(start[index[id(v)]]) for v in sharded.variables]
    ring = reduction.ring(spec.ring)
    take_round_rates(model, stepper, spec)
    reduce_s = 0.0
    nonfinite = overflowed = 0
    model.reset_metrics()
    stepper.begin()
    batches = iter(feed)
    factor = None
    try:
        try:
            missing = sharded.begin(ring, spec.shard or "fresh", spec.fresh, session.restored_shard, trainable)
            session.restored_shard = None
            session.rng_start = rng_state(model)
            session.in_flight = spec.round_no  # until _end_round: a checkpoint meanwhile takes the start states
            for step in range(spec.steps):
                factor = _warm_up(stepper, spec.learning_rate_factor, step, spec.steps, factor)
                batch = next(batches, None)
                grads, weight = None, 0.0
                if batch is not None:
                    bx, by, sw, n = batch
                    grads = stepper.gradients(bx, by, sw)
                    weight = n / batch_size
                    if spec.slow_seconds_per_batch:
                        time.sleep(spec.slow_seconds_per_batch)
                    if not stepper.scaled and not all(finite(g) for g in grads):
                        log.warning(
                            "run %s: non-finite gradients on a batch of %d rows: left out of the step", spec.run_id, n
                        )
                        grads, weight = None, 0.0
                        nonfinite += 1
                t_reduce = time.perf_counter()
                taken = sharded.step(grads, weight, ring, wire)
                reduce_s += time.perf_counter() - t_reduce
                if taken == "overflow":
                    overflowed += 1
                elif taken == "step":
                    stepper.set_trainable(sharded.weight_views)
        except BaseException:
            reduction.forget(spec.ring.group)  # the ring is spent (or out of step): the master retires it
            raise
    finally:
        logs = stepper.end()
    out = _end_round(session, spec, start, t0, feed, logs, reduce_s, nonfinite, overflowed, sharded.state_bytes())
    out["optimizer_elements_lost"] = missing
    return out
