"""Pure logic of ``Cluster.from_slurm``: reading the allocation from Slurm's environment, the srun command line,
and the rendezvous that refuses a report without the job's token (``ddlf.cluster.slurm``, ``.rendezvous``)."""

from __future__ import annotations

import socket
import threading

import pytest

from ddlf import rendezvous
from ddlf.cluster.slurm import SlurmAllocation, expand_counts, expand_nodelist, srun_command
from ddlf.errors import LaunchError


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("node0", ["node0"]),
        ("node[0-2]", ["node0", "node1", "node2"]),
        ("gpu[01-03,7],cpu5", ["gpu01", "gpu02", "gpu03", "gpu7", "cpu5"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ],
)
def test_node_lists_expand_as_scontrol_show_hostnames_does(text: str, names: list[str]) -> None:
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("bad", ["node[a-b]", "node[3-1]"])
def test_a_node_list_that_cannot_be_read_says_where(bad: str) -> None:
    with pytest.raises(LaunchError, match="node list"):
        expand_nodelist(bad)


def test_tasks_per_node_counts() -> None:
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE"):
        expand_counts("2(y3)")


def test_the_allocation_comes_from_slurms_environment() -> None:
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[0-2]",
        "SLURM_TASKS_PER_NODE": "2(x2),1",
        "SLURM_CPUS_PER_TASK": "4",
        "SLURM_GPUS_ON_NODE": "2",
        "SLURM_RESTART_COUNT": "3",
    }
    a = SlurmAllocation.from_environ(env)
    assert (a.job_id, a.nodes, a.tasks_per_node, a.ntasks) == ("42", ("node0", "node1", "node2"), (2, 2, 1), 5)
    assert (a.cpus_per_task, a.gpus_per_node, a.restart_count) == (4, 2, 3)
    cmd = srun_command(a, python="/py", log_dir="/logs")
    assert cmd[0] == "srun" and "--ntasks=5" in cmd and "--nodes=3" in cmd and "--cpus-per-task=4" in cmd
    assert "--output=/logs/worker-%N-%t.log" in cmd
    assert cmd[cmd.index("/py") :] == ["/py", "-m", "ddlf.worker", "--listen", "0.0.0.0:0", "--threads", "4"]
    gpus = srun_command(a, per="gpu")
    assert "--ntasks=6" in gpus and "--ntasks-per-node=2" in gpus and "--gpus-per-task=1" in gpus


def test_outside_an_allocation_or_with_odd_settings_the_error_says_what_to_do() -> None:
    with pytest.raises(LaunchError, match=r"not inside a Slurm allocation.*sbatch"):
        SlurmAllocation.from_environ({})
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
        SlurmAllocation.from_environ({"SLURM_JOB_ID": "1"})
    with pytest.raises(LaunchError, match="gives 1 nodes"):
        SlurmAllocation.from_environ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2"})
    no_gpus = SlurmAllocation.from_environ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"})
    assert no_gpus.tasks_per_node == (1,)
    with pytest.raises(LaunchError, match="no GPUs"):
        srun_command(no_gpus, per="gpu")
    with pytest.raises(ValueError, match="per must be"):
        srun_command(no_gpus, per="node")


def test_the_rendezvous_takes_reports_signed_with_the_token_and_refuses_others() -> None:
    with rendezvous.Rendezvous("job-token", host="127.0.0.1") as r:
        master = f"127.0.0.1:{r.port}"

        def enlist() -> None:
            # A stranger (wrong token), garbage, then the two real workers, out of rank order.
            rendezvous.report(master, "wrong", 0, 5000, "intruder")
            with socket.create_connection(("127.0.0.1", r.port)) as s:
                s.sendall(b"not json\n")
            rendezvous.report(master, "job-token", 1, 7002, "node1-0")
            rendezvous.report(master, "job-token", 0, 7001, "node0-0")

        t = threading.Thread(target=enlist)
        t.start()
        found = r.wait(2, timeout=20)
        t.join()
    assert [(w.rank, w.address, w.name) for w in found] == [
        (0, "127.0.0.1:7001", "node0-0"),
        (1, "127.0.0.1:7002", "node1-0"),
    ]
    assert r.refused == 2


def test_the_rendezvous_gives_up_with_the_missing_ranks() -> None:
    with (
        rendezvous.Rendezvous("t", host="127.0.0.1") as r,
        pytest.raises(LaunchError, match=r"0 of 2 workers.*\[0, 1\]"),
    ):
        r.wait(2, timeout=0.5)
    with (
        rendezvous.Rendezvous("t", host="127.0.0.1") as r,
        pytest.raises(LaunchError, match=r"launcher ended.*status 1"),
    ):
        r.wait(1, timeout=10, alive=lambda: "srun exited with status 1")
