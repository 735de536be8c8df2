"""Seeing what the cluster does: the HTML training report (rendered in headless Chromium), TensorBoard event
files, workers' logs with request ids (``cluster.logs``, ``ddlf logs``)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from scripts.chromium import dump_dom, find_chromium, screenshot

import ddlf

from ..conftest import MNIST_DIR, Daemon, wait_until
from .apps import SmallMnist

PHASE_COLOURS = {"compute": (0x00, 0x9E, 0x73), "send": (0x00, 0x72, 0xB2)}


def _chromium() -> str:
    browser = find_chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have chromium: scripts/test.sh installs Debian's package")
        pytest.skip("no chromium on this machine (scripts/test.sh installs it)")
    return browser


@pytest.fixture(scope="module")
def trained(cluster: ddlf.Cluster, tmp_path_factory: pytest.TempPathFactory):
    """One short sync run with a report and a TensorBoard callback, shared by the tests below."""
    out = tmp_path_factory.mktemp("observability")
    app = SmallMnist(cluster)
    (x, y), _ = ddlf.datasets.mnist(MNIST_DIR)
    t0 = time.monotonic()
    history = app.train(
        epochs=2,
        batch_size=32,
        validation_data=(x[-500:], y[-500:]),
        verbose=0,
        callbacks=[ddlf.callbacks.TensorBoard(out / "tb", update_freq="round")],
        strategy=ddlf.ModelAveraging(every=10),
        run=ddlf.RunConfig(report=out / "run.html"),
    )
    history.test_wall_seconds = time.monotonic() - t0
    return out, history


def test_report_is_self_contained_and_holds_the_run(trained) -> None:
    out, history = trained
    text = (out / "run.html").read_text()
    # Self-contained: nothing fetched, no script to run.
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)
    assert "<script src" not in text and "@import" not in text
    for chart in ("chart-loss", "chart-metrics", "timeline", "breakdown"):
        assert f"id='{chart}'" in text
    # One timeline bar per (round, worker), each split into its phases.
    rounds = {(s.epoch, s.round, s.worker) for s in history.stats}
    assert len(rounds) == len(history.stats) == 2 * 5 * 2  # 1,500 rows per worker, 320 per round: 5 rounds
    assert text.count("class='seg compute'") == len(history.stats)
    assert all(s.start > 0 and s.send_seconds > 0 for s in history.stats)
    # Communication is the call's time less the worker's compute: measured (not all zero), never negative, and
    # each round's phases a part of the run's own time (no bound on the clock: the machine may be loaded).
    assert any(s.comm_seconds > 0 for s in history.stats)
    assert all(s.comm_seconds >= 0 for s in history.stats), [s.comm_seconds for s in history.stats]
    assert all(
        s.send_seconds + s.compute_seconds + s.comm_seconds < history.test_wall_seconds for s in history.stats
    ), [(s.send_seconds, s.compute_seconds, s.comm_seconds) for s in history.stats]
    # The numbers, embedded and beside it.
    embedded = re.search(r'<script type="application/json" id="ddlf-stats">(.*?)</script>', text, re.S)
    assert embedded is not None
    saved = json.loads((out / "run.json").read_text())
    assert json.loads(embedded.group(1))["history"] == saved["history"] == history.history
    assert len(saved["stats"]) == len(history.stats)
    assert saved["summary"]["workers"]["0"]["samples"] == 3000


def test_report_renders_in_headless_chromium(trained) -> None:
    _chromium()  # skips, or fails in CI, where there is none
    out, history = trained
    # The browser's DOM after parsing: the charts are there with their marks (an unclosed tag or a bad
    # attribute would nest or drop them).
    dom = dump_dom(out / "run.html")
    loss_svg = re.search(r'<svg id="chart-loss".*?</svg>', dom, re.S)
    assert loss_svg is not None
    assert loss_svg.group(0).count('class="series"') == 2  # loss and val_loss, siblings (not nested)
    timeline = re.search(r'<svg id="timeline".*?</svg>', dom, re.S)
    assert timeline is not None and timeline.group(0).count('class="seg compute"') == len(history.stats)
    # And pixels: the picture has the chart colours where the charts are.
    png = screenshot(out / "run.html", out / "run.png", width=1200, height=1400)
    from PIL import Image

    img = Image.open(png).convert("RGB")
    assert img.size == (1200, 1400)
    colours = {c for _, c in img.getcolors(maxcolors=1 << 20)}
    for name, rgb in PHASE_COLOURS.items():
        assert any(max(abs(a - b) for a, b in zip(c, rgb)) <= 8 for c in colours), f"no {name} colour drawn"
    assert len(colours) > 50  # text, lines and bars, not a blank page


def test_report_of_a_run_with_a_lost_worker_shows_it(tmp_path: Path) -> None:
    from ddlf.report.training import write_report
    from ddlf.training.history import History, RoundStats

    h = History(params={"mode": "sync", "workers": 2, "samples": 100, "batch_size": 10})
    h.record_epoch({"loss": 1.0, "accuracy": 0.5}, 1.0)
    h.stats = [
        RoundStats(0, 0, 0, 50, 0.5, 0.1, 0.01, 10, 10, start=0.1, send_seconds=0.01, comm_seconds=0.02),
        RoundStats(0, 0, 1, 0, 0.0, 0.6, 0.0, 0, 0, lost=True, start=0.1),
    ]
    h.events = [{"time": 1.0, "event": "lost", "worker": 1, "address": "10.0.0.3:7070", "epoch": 0, "round": 0}]
    text = write_report(h, tmp_path / "r.html").read_text()
    assert "class='seg lost'" in text and "10.0.0.3:7070" in text and "rounds lost" in text


def test_tensorboard_event_files_read_back(trained) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, history = trained
    train = EventAccumulator(str(out / "tb" / "train"))
    train.Reload()
    tags = set(train.Tags()["scalars"])
    assert {"epoch_loss", "epoch_accuracy", "ddlf/samples_per_second", "ddlf/bytes_on_wire"} <= tags
    for w in (0, 1):
        for what in ("compute_seconds", "data_wait_seconds", "communication_seconds", "wait_seconds"):
            assert f"ddlf/worker_{w}/{what}" in tags
    loss = [e.value for e in train.Scalars("epoch_loss")]
    assert [e.step for e in train.Scalars("epoch_loss")] == [0, 1]
    assert np.allclose(loss, history.history["loss"], rtol=1e-6)
    compute = train.Scalars("ddlf/worker_0/compute_seconds")
    assert compute[0].value == pytest.approx(
        sum(s.compute_seconds for s in history.stats if s.worker == 0 and s.epoch == 0), rel=1e-5
    )
    assert len(train.Scalars("round_loss")) == 10  # update_freq="round": 5 rounds per epoch
    val = EventAccumulator(str(out / "tb" / "validation"))
    val.Reload()
    assert np.allclose([e.value for e in val.Scalars("epoch_loss")], history.history["val_loss"], rtol=1e-6)


def test_a_bad_report_path_is_refused_before_training(cluster: ddlf.Cluster, tmp_path: Path) -> None:
    app = SmallMnist(cluster)
    (tmp_path / "a-file").write_text("")
    for bad, why in (
        (tmp_path / "run.txt", "give an .html file name"),
        (tmp_path / "a-file" / "run.html", "not a writable directory"),
    ):
        with pytest.raises(ValueError, match=why):
            app.train(epochs=1, verbose=0, run=ddlf.RunConfig(report=bad))
    assert cluster.run(lambda: "still serving") == ["still serving", "still serving"]
    assert not list(tmp_path.glob("*.json"))


def test_timings_of_each_call_cover_its_workers(cluster: ddlf.Cluster) -> None:
    cluster.run(lambda: None)
    timings = cluster.last_call_timings()
    assert sorted(timings) == [0, 1] and all(call >= work > 0 for work, call in timings.values())
    cluster.run_on(1, lambda: None)
    assert list(cluster.last_call_timings()) == [1]


def test_tensorboard_rejects_a_bad_update_freq() -> None:
    with pytest.raises(ValueError, match="update_freq"):
        ddlf.callbacks.TensorBoard("x", update_freq="batch")


def _fail_loudly(tag: str) -> None:
    logging.getLogger("user.code").info("about to fail on %s", tag)
    raise ValueError(f"no good: {tag}")


def test_worker_logs_carry_the_request_id_and_function(cluster: ddlf.Cluster) -> None:
    with pytest.raises(ddlf.RemoteError) as info:
        cluster.run_on(1, _fail_loudly, "input-17")
    rid = info.value.request_id
    assert isinstance(rid, int) and rid > 0
    lines = cluster.logs(1, 50)
    mine = [line for line in lines if f"id={rid} " in line]
    assert any("op=run:_fail_loudly" in line and "about to fail on input-17" in line for line in mine), mine
    assert any("call failed: ValueError: no good: input-17" in line and "WARN" in line for line in mine), mine
    assert not any(f"id={rid} " in line for line in cluster.logs(0, 50))  # it ran on worker 1 only
    # n lines, the newest last; the worker still serves.
    assert len(cluster.logs(1, 3)) == 3
    assert cluster.run_on(1, lambda: 7) == 7


def test_logs_are_read_while_user_code_runs(cluster: ddlf.Cluster, tmp_path) -> None:
    gate = str(tmp_path / "gate")

    def slow(gate: str) -> str:
        logging.getLogger("user.code").warning("slow function started")
        deadline = time.monotonic() + 30
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return "done" if os.path.exists(gate) else "gave up"

    result: dict[str, str] = {}
    runner = threading.Thread(target=lambda: result.setdefault("value", cluster.run_on(0, slow, gate)))
    runner.start()
    try:
        assert wait_until(lambda: cluster.status()[0]["running"] is not None, 20)
        # The function ends only once the gate opens, after the logs came back: they were answered by the
        # network thread while it ran, not queued behind it (which would have hit the deadline).
        lines = cluster.logs(0, 20, timeout=10)
    finally:
        open(gate, "w").close()
        runner.join(40)
    assert result == {"value": "done"}
    assert any("slow function started" in line for line in lines)


def test_logs_bad_input(cluster: ddlf.Cluster) -> None:
    with pytest.raises(ValueError, match="n must be"):
        cluster.logs(0, -1)
    with pytest.raises(IndexError):
        cluster.logs(5)
    assert cluster.logs(0, 1) and len(cluster.logs(0, 0)) >= len(cluster.logs(0, 5))


def test_ddlf_logs_command(daemon: Daemon) -> None:
    env = {**os.environ, "DDLF_TOKEN": daemon.token or ""}
    c = ddlf.Cluster([daemon.address], token=daemon.token)
    with pytest.raises(ddlf.RemoteError) as info:
        c.run(_fail_loudly, "from-cli")
    c.close()
    out = subprocess.run(
        [sys.executable, "-m", "ddlf.cli", "logs", daemon.address, "-n", "20"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"id={info.value.request_id} " in out.stdout and "no good: from-cli" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "ddlf.cli", "logs", daemon.address, "127.0.0.1:1", "--timeout", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 1 and "127.0.0.1:1" in bad.stderr and f"==> {daemon.address} <==" in bad.stdout
