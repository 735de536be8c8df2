"""The ways to get a :class:`~ddlf.Cluster` beyond connecting to running daemons: daemons started on this machine
(:meth:`~Launchers.local`), listed in a ``cluster.toml``, started in a Slurm allocation, or a Kubernetes
StatefulSet's. Mixed into :class:`~ddlf.Cluster`; each ends in its constructor."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..process import hold_signals
from .local import start_local

_C = TypeVar("_C", bound="Launchers")


class Launchers:
    """The classmethods of :class:`~ddlf.Cluster` that start or find its workers, then connect."""

    if TYPE_CHECKING:  # Cluster's constructor, which each ends in

        def __init__(self, addresses: Sequence[str], token: str | None = None, **kwargs: Any) -> None: ...

    @classmethod
    def local(
        cls: type[_C],
        n_workers: int | None = None,
        *,
        threads: int | None = None,
        timeout: float | None = None,
        start_timeout: float = 60.0,
        worker_args: Sequence[str] = (),
        shared_memory: bool = False,
        direct_lane: bool = True,
        lane_spin_us: int | None = None,
        preload: str | Sequence[str] | None = "default",
        gpus: str | Sequence[int | str] | None = None,
    ) -> _C:
        """Start ``n_workers`` daemons on free loopback ports and connect to them.

        The daemons get a fresh random token and stop when the cluster is closed, when the ``with`` block is
        left, at interpreter exit, or when this process dies. ``threads`` caps each worker's math-library
        thread pools (default: the machine's cores divided among the workers).

        ``preload``: modules each daemon imports in the background as soon as it listens, while this script goes
        on (``ddlf-worker --preload``). The default, ``"keras"`` (``"torch"`` in a PyTorch script, below), loads
        Keras on this process's backend (``KERAS_BACKEND``, else ddlf's default, which this sets for the workers)
        when Keras is installed, so a
        first ``train()`` does not wait for the framework to import. A request that runs or sends code (``run``,
        ``set``, ``train``...) while a daemon still preloads waits for the preload to finish (a few seconds for
        Keras on TensorFlow; count it in a short ``timeout``). ``None``: nothing. ``"default"``: ``DDLF_PRELOAD``
        if set (comma-separated modules; empty: nothing), else ``"keras"``, or ``"torch"`` when this script has
        imported torch and not Keras (a ``TorchModel`` needs neither Keras nor TensorFlow on the workers).

        ``gpus``: one worker per GPU, each seeing only its own (``ddlf-worker --gpu``): ``"auto"`` for every GPU
        this process may use (``CUDA_VISIBLE_DEVICES``, else all that ``nvidia-smi`` lists), or a list of ids.
        ``n_workers`` then defaults to the number of GPUs (and must equal it if given). Default: 2 workers, no
        GPU assignment.
        """
        local = start_local(
            n_workers,
            threads=threads,
            start_timeout=start_timeout,
            worker_args=worker_args,
            lane_spin_us=lane_spin_us,
            preload=preload,
            gpus=gpus,
        )
        try:
            return cls(
                local.addresses,
                local.token,
                timeout=timeout,
                shared_memory=shared_memory,
                direct_lane=direct_lane,
                lane_spin_us=lane_spin_us,
                _local=local,
            )
        except BaseException:
            local.terminate()
            raise

    @classmethod
    def from_config(cls: type[_C], path: str | os.PathLike[str], **overrides: Any) -> _C:
        """Connect to the workers listed in a ``cluster.toml`` (see :mod:`ddlf.cluster.cluster_file`); keyword arguments
        override the file's settings."""
        from .cluster_file import load

        cfg = load(path)
        return cls(cfg.workers, **{**cfg.cluster_kwargs(), **overrides})

    @classmethod
    def from_slurm(
        cls: type[_C],
        *,
        per: str = "task",
        python: str | None = None,
        start_timeout: float = 120.0,
        worker_args: Sequence[str] = (),
        run_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> _C:
        """Start a worker daemon per task of the Slurm allocation this script runs in (``sbatch``, ``salloc``)
        with one ``srun`` step, and connect to them; closing the cluster stops them.

        No SSH, no cluster file, no fixed port: each worker binds a free port and reports it (with an HMAC under a
        token made for this job, passed in ``srun``'s environment) to this process (:mod:`ddlf.cluster.slurm`).
        ``per="gpu"``: one worker per GPU of each node (``--gpus-per-task=1``). ``python``: the workers'
        interpreter (default this one). Worker logs go to ``run_dir`` (default ``DDLF_RUN_DIR``, else
        ``./ddlf-<job id>``), one file per worker. ``token``: the workers' token (default: one made for this job).
        Other keyword arguments go to :class:`Cluster`. Outside an allocation: :class:`~ddlf.errors.LaunchError`.

        From here on, Slurm's advance warning (SIGUSR1, ``#SBATCH --signal=B:USR1@N``) no longer ends the script
        where it arrives outside ``train()``: it is kept, and the next ``train()`` with a ``checkpoint_dir``
        stops at its start with a checkpoint and requeues the job (:func:`ddlf.process.hold_signals`)."""
        from .slurm import SlurmWorkers

        if os.environ.get("SLURM_JOB_ID"):
            hold_signals()  # before the workers start: that takes seconds too
        workers = SlurmWorkers(
            per=per,
            python=python,
            start_timeout=start_timeout,
            worker_args=worker_args,
            run_dir=run_dir,
            token=kwargs.pop("token", None),
        )
        try:
            return cls(workers.addresses, workers.token, _local=workers, **kwargs)
        except BaseException:
            workers.terminate()
            raise

    @classmethod
    def from_kubernetes(
        cls: type[_C],
        service: str = "ddlf-workers",
        namespace: str | None = None,
        replicas: int | None = None,
        *,
        port: int = 7070,
        statefulset: str | None = None,
        cluster_domain: str = "cluster.local",
        **kwargs: Any,
    ) -> _C:
        """Connect to the workers of a StatefulSet behind a headless Service (``deploy/kubernetes``), by their
        stable DNS names ``<statefulset>-<i>.<service>.<namespace>.svc.<cluster_domain>:<port>``. ``namespace``
        defaults to ``DDLF_K8S_NAMESPACE``, then the pod's own namespace, then ``default``; ``replicas=None``
        counts the pods whose names resolve. The token comes from ``token=`` or ``DDLF_TOKEN``."""
        from .cluster_file import kubernetes_addresses

        addresses = kubernetes_addresses(
            service, namespace, replicas, port=port, statefulset=statefulset, cluster_domain=cluster_domain
        )
        return cls(addresses, **kwargs)
