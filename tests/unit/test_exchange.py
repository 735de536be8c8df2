"""Which exchange a synchronous run uses (``ddlf.training.exchange.resolve``), and ring plans: pure logic."""

from __future__ import annotations

import pytest

import ddlf
from ddlf.cluster.rings import RingPlan, Rings
from ddlf.ring_spec import check_op
from ddlf.training.exchange import resolve


class FakeCluster:
    def __init__(self, addresses: list[str], tls: bool = False) -> None:
        self.addresses = addresses
        self.uses_tls = tls


ONE_HOST = FakeCluster(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
TWO_HOSTS = FakeCluster(["10.0.0.1:7070", "10.0.0.2:7070", "10.0.0.2:7071"])


def test_auto_takes_the_ring_only_across_hosts() -> None:
    auto = ddlf.AutoExchange()
    assert resolve(auto, ONE_HOST, [0, 1, 2]) == ddlf.ThroughMaster()
    assert resolve(auto, TWO_HOSTS, [0, 1, 2]) == ddlf.Ring()
    assert resolve(auto, TWO_HOSTS, [1, 2]) == ddlf.ThroughMaster()  # the run's workers share one host
    # half precision on whichever it picks, and the ring's hierarchy when it picks the ring
    half = ddlf.AutoExchange(compression="float16", hierarchical=False)
    assert resolve(half, TWO_HOSTS, [0, 1]) == ddlf.Ring(hierarchical=False, compression="float16")
    assert resolve(half, ONE_HOST, [0, 1]) == ddlf.ThroughMaster(compression="float16")
    # TLS clusters ring over TLS peer links: the same rule.
    assert resolve(auto, FakeCluster(TWO_HOSTS.addresses, tls=True), [0, 1]) == ddlf.Ring()


def test_explicit_choices_and_refusals() -> None:
    assert resolve(ddlf.ThroughMaster(), TWO_HOSTS, [0, 1]) == ddlf.ThroughMaster()
    assert resolve(ddlf.Ring(), ONE_HOST, [0, 1]) == ddlf.Ring()
    with pytest.raises(ValueError, match="compression"):
        ddlf.Ring(compression="topk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compression"):
        ddlf.AutoExchange(compression=ddlf.TopK())  # type: ignore[arg-type]  # the ring does not do top-k
    with pytest.raises(TypeError, match="exchange must be"):
        ddlf.ModelAveraging(exchange="ring")  # type: ignore[arg-type]


def test_ring_plans_name_ranks_and_a_new_group_after_a_loss() -> None:
    rings = Rings()
    plan = rings.plan((0, 2, 3), ("a:1", "b:1", "c:1"), (7, 8, 9))
    assert plan.spec(2).rank == 1 and plan.spec(3).addresses == ("a:1", "b:1", "c:1")
    assert rings.plan((0, 2, 3), ("a:1", "b:1", "c:1"), (7, 8, 9)) is plan  # kept while it works
    smaller = rings.plan((0, 3), ("a:1", "c:1"), (7, 9))  # worker 2 lost
    assert smaller.workers == (0, 3) and smaller.addresses == ("a:1", "c:1")
    assert smaller.group != plan.group and len(plan.group) == 32
    rings.retire(plan)  # it failed: the same workers get a new ring
    assert rings.plan((0, 2, 3), ("a:1", "b:1", "c:1"), (7, 8, 9)).group != plan.group
    assert rings.plan((0, 3), ("a:1", "c:1"), (7, 10)).group != smaller.group  # worker 3's daemon restarted
    assert check_op("sum") == "sum"
    with pytest.raises(ValueError, match="op must be"):
        check_op("max")


def test_ring_plans_refuse_bad_settings() -> None:
    with pytest.raises(ValueError, match="streams"):
        RingPlan((0, 1), ("a:1", "b:1"), streams=0)
    with pytest.raises(ValueError, match="timeout"):
        RingPlan((0, 1), ("a:1", "b:1"), timeout=0)
    with pytest.raises(ValueError, match="one address per worker"):
        RingPlan((0, 1), ("a:1",))


def test_a_preemption_checkpoint_never_pairs_old_weights_with_a_later_round() -> None:
    """With the ring the workers hold the weights; when none answers, the master's own copy is older than the last
    round, and :meth:`RingExchange.current_weights` refuses it (the previous checkpoint then stands) where
    :meth:`RingExchange.weights` (epoch ends, validation) takes it."""
    import numpy as np

    from ddlf.errors import WorkerUnavailable
    from ddlf.training.exchange import RingExchange
    from ddlf.training.run import RunState

    class Gone:
        def run_on(self, *args: object, **kw: object) -> object:
            raise WorkerUnavailable("worker 0 lost", worker_id=0)

    class Run:
        cluster = Gone()
        state = RunState(run_id="r")
        resumed = None
        optimizer_adopted = False

    start = [np.zeros(3, np.float32)]
    ex = RingExchange(Run(), start)  # type: ignore[arg-type]
    assert ex.current_weights() is start  # no round yet: the start is current
    ex.round, ex.synced = 4, {0: 1}
    assert ex.weights() is start
    with pytest.raises(LookupError, match="round 4"):
        ex.current_weights()
