"""Which exchange a synchronous run uses (``ddlf.training.exchange.choose``), and ring plans: pure logic."""

from __future__ import annotations

import pytest

from ddlf.cluster.rings import RingPlan, Rings
from ddlf.ring_spec import check_op
from ddlf.training.exchange import choose
from ddlf.training.options import TrainConfig


class FakeCluster:
    def __init__(self, addresses: list[str], tls: bool = False) -> None:
        self.addresses = addresses
        self.uses_tls = tls


ONE_HOST = FakeCluster(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
TWO_HOSTS = FakeCluster(["10.0.0.1:7070", "10.0.0.2:7070", "10.0.0.2:7071"])


def test_auto_takes_the_ring_only_across_hosts() -> None:
    assert choose("auto", ONE_HOST, [0, 1, 2], None) == "master"
    assert choose("auto", TWO_HOSTS, [0, 1, 2], None) == "allreduce"
    assert choose("auto", TWO_HOSTS, [1, 2], None) == "master"  # the run's workers share one host
    assert choose("auto", TWO_HOSTS, [0, 1], "float16") == "allreduce"  # half precision on the ring's links
    assert choose("auto", TWO_HOSTS, [0, 1], "topk") == "master"  # what the ring does not do
    # TLS clusters ring over TLS peer links: the same rule.
    assert choose("auto", FakeCluster(TWO_HOSTS.addresses, tls=True), [0, 1], None) == "allreduce"


def test_explicit_choices_and_refusals() -> None:
    assert choose("master", TWO_HOSTS, [0, 1], None) == "master"
    assert choose("allreduce", ONE_HOST, [0, 1], None) == "allreduce"
    with pytest.raises(ValueError, match="compression"):
        choose("allreduce", ONE_HOST, [0, 1], "topk")
    with pytest.raises(ValueError, match="exchange must be"):
        choose("ring", ONE_HOST, [0, 1], None)
    with pytest.raises(ValueError, match="exchange must be"):
        TrainConfig(epochs=1, batch_size=1, exchange="ring").check()


def test_ring_plans_name_ranks_and_a_new_group_after_a_loss() -> None:
    rings = Rings()
    plan = rings.plan((0, 2, 3), ("a:1", "b:1", "c:1"), (7, 8, 9))
    assert plan.spec(2)["rank"] == 1 and plan.spec(3)["addresses"] == ["a:1", "b:1", "c:1"]
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
