"""What a restarted daemon gets again (``ddlf.cluster.recovery.ReplayLog``), without daemons."""

from __future__ import annotations

from ddlf.cluster.recovery import ReplayLog


def test_push_order_with_a_repeated_push_moved_to_the_end() -> None:
    log = ReplayLog()
    log.record("module", "helpers", b"v1")
    log.record("fn", "step", ("d1", b"blob"))
    log.record("module", "helpers", b"v2")  # code pushed after it may import the new version
    assert list(log.entries) == [("fn", "step"), ("module", "helpers")]
    assert log.entries[("module", "helpers")] == b"v2"


def test_each_exec_is_kept_in_order_and_training_values_are_not() -> None:
    log = ReplayLog()
    log.record("exec", "", "import math")
    log.record("var", "__ddlf_weights/run1", b"w")  # training re-sends its own per-round values
    log.record("exec", "", "k = math.pi")
    assert [(kind, payload) for (kind, _), payload in log.entries.items()] == [
        ("exec", "import math"),
        ("exec", "k = math.pi"),
    ]


def test_variables_per_address_merge_and_forget() -> None:
    log = ReplayLog()
    log.record("var", "lr", b"all")
    log.record_on("lr", {"a:1": b"only-a"})
    entry = log.entries[("var", "lr")]
    assert log.variable_for(entry, "a:1") == b"only-a" and log.variable_for(entry, "b:1") == b"all"
    log.forget_on("lr", {"a:1"})
    entry = log.entries[("var", "lr")]
    assert log.variable_for(entry, "a:1") is None and log.variable_for(entry, "b:1") == b"all"


def test_a_variable_deleted_on_one_worker_is_still_replayed_to_the_others() -> None:
    log = ReplayLog()
    log.record("var", "shard", b"everyone")
    log.forget_on("shard", {"a:1"})  # deleted on worker a only
    entry = log.entries.get(("var", "shard"))
    assert entry is not None, "b:1 still holds it: a restarted b must get it back"
    assert log.variable_for(entry, "a:1") is None and log.variable_for(entry, "b:1") == b"everyone"
    log.forget("var", "shard")
    assert ("var", "shard") not in log.entries


def test_clean_keeps_datasets() -> None:
    log = ReplayLog()
    log.record("var", "x", b"1")
    log.record("fn", "f", ("d", b"b"))
    log.record("dataset", "mnist", ("load", None))
    log.clean()
    assert list(log.entries) == [("dataset", "mnist")]
