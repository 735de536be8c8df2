"""Spark as ddlf's data supplier: train from a DataFrame without leaving the Spark cluster.

Two ways, as the literature does it:

- **Export once** (Deeplearning4j's approach): :func:`export` writes the DataFrame as Parquet on storage every
  worker reads (HDFS, S3, NFS, a local path for one machine), Spark ML vectors turned into arrays. Workers load
  it with :func:`ddlf.datasets.parquet`, whole or by shard (``shard=(i, n)``); Spark and ddlf then run apart.
- **Hosted** (the Spark-to-MPI approach): :func:`hosted` starts one ddlf worker inside each task of a Spark
  *barrier* stage, so every worker runs on an executor beside its partition; each task writes its partition once
  into shared memory (``/dev/shm``) as ``.npy`` files that its worker maps, and hands the worker's address to the
  driver, which connects to them as a :class:`~ddlf.Cluster`. The data never leaves the executor's host. A
  :class:`SparkApp` trains on those partitions (a sharded app: worker ``i`` holds partition ``i``).

Both need pyspark (``pip install pyspark``; Spark needs a Java runtime), imported only when called.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..cluster.cluster import Cluster
from ..cluster.local import start_worker, wait_ready
from ..errors import ConfigError, DatasetError, WorkerStartError
from ..process import PARENT_ENV
from ..training.app import IApp

PARTITION_ENV = "DDLF_SPARK_PARTITION"
"""Set for a hosted worker: the directory of its partition's ``.npy`` files."""


def _vectors_to_arrays(df: Any) -> Any:
    """Spark ML vector columns as arrays of float (Parquet and Arrow have no vector type)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT

    for f in df.schema.fields:
        if isinstance(f.dataType, VectorUDT):
            df = df.withColumn(f.name, vector_to_array(f.name, "float32"))
    return df


def export(df: Any, path: str, *, columns: Sequence[str] | None = None, mode: str = "overwrite") -> str:
    """Write ``df`` (its ``columns``, default all) as Parquet under ``path`` for ddlf workers to read with
    :func:`ddlf.datasets.parquet` (``shard=(i, n)`` for one worker's share). Spark ML vector columns become
    arrays of float32. ``mode``: Spark's save mode. Returns ``path``."""
    if columns is not None:
        df = df.select(*columns)
    _vectors_to_arrays(df).write.mode(mode).parquet(path)
    return path


def partition() -> tuple[np.ndarray, np.ndarray] | np.ndarray:
    """On a worker started by :func:`hosted`: its partition, ``(x, y)`` (or ``x`` without a label), mapped
    read-only from the shared-memory files its Spark task wrote."""
    where = os.environ.get(PARTITION_ENV)
    if not where:
        raise DatasetError("ddlf.spark.partition() runs on a worker started by ddlf.spark.hosted()")
    x = np.load(os.path.join(where, "x.npy"), mmap_mode="r")
    y_path = os.path.join(where, "y.npy")
    return (x, np.load(y_path, mmap_mode="r")) if os.path.exists(y_path) else x


class SparkApp(IApp):
    """An app that trains on the partitions of :func:`hosted`: worker ``i`` holds Spark partition ``i``.
    Implement ``create_model`` (and ``preprocess`` if needed); the dataset comes from Spark."""

    sharded = True
    dataset_key = "spark-partition"

    def load_dataset(self) -> Any:
        return partition()

    def load_shard(self, shard: int, n_shards: int) -> Any:
        # Memory-mapped arrays: the host's copy is the task's shared-memory files already (never re-shared under
        # this key by the node store, which keeps only in-memory arrays).
        return partition()


def _table_arrays(table: Any, features: Sequence[str], label: str | None, dtype: Any) -> dict[str, np.ndarray]:
    from ..data.parquet import _column_array, _features

    out = {"x": _features("partition", table, features, dtype)}
    if label is not None:
        out["y"] = _column_array("partition", label, table.column(label))
    return out


def _serve_partition(
    batches: Iterator[Any],
    *,
    features: Sequence[str],
    label: str | None,
    dtype: Any,
    token: str,
    driver: tuple[str, int],
    worker_args: Sequence[str],
    start_timeout: float,
) -> Iterator[Any]:
    """The body of each barrier task: write the partition to shared memory, start a worker beside it, report its
    address to the driver, and keep it until the driver says stop (or goes away)."""
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    pid = ctx.partitionId()
    host = ctx.getTaskInfos()[pid].address.rsplit(":", 1)[0]
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    where = tempfile.mkdtemp(prefix=f"ddlf-spark-{pid}-", dir=base)
    proc: subprocess.Popen[bytes] | None = None
    try:
        collected = list(batches)
        table = pa.Table.from_batches(collected) if collected else None
        rows = 0 if table is None else table.num_rows
        if table is not None:
            for name, a in _table_arrays(table, features, label, dtype).items():
                np.save(os.path.join(where, f"{name}.npy"), a, allow_pickle=False)
        # The worker exits with its task's Python (``die_with_parent``), even if Spark kills that with SIGKILL.
        env = {**os.environ, "DDLF_TOKEN": token, PARTITION_ENV: where, PARENT_ENV: str(os.getpid())}
        env.setdefault("DDLF_LOG", "warn")
        listen = "127.0.0.1:0" if host in ("localhost", "127.0.0.1") else "0.0.0.0:0"
        ready = os.path.join(where, "ready")
        proc = start_worker(listen, f"spark-{pid}", ready, env, list(worker_args))
        port = wait_ready(proc, ready, start_timeout).rsplit(":", 1)[1]
        with socket.create_connection(driver, timeout=30) as conn:
            hello = {"partition": pid, "address": f"{host}:{port}", "rows": rows}
            conn.sendall(json.dumps(hello).encode() + b"\n")
            conn.settimeout(None)
            conn.recv(1)  # "stop", or the driver went away: either way the worker's job is done
        yield pa.RecordBatch.from_pydict({"partition": [pid], "rows": [rows]})
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(where, ignore_errors=True)


@contextlib.contextmanager
def hosted(
    df: Any,
    features: Sequence[str] | str,
    label: str | None = None,
    *,
    num_workers: int | None = None,
    dtype: Any = "float32",
    worker_args: Sequence[str] = (),
    start_timeout: float = 120.0,
    **cluster_kwargs: Any,
) -> Iterator[Cluster]:
    """A :class:`~ddlf.Cluster` of ddlf workers running inside Spark's executors, one per partition of ``df``.

    ``df`` is repartitioned to ``num_workers`` (default: its partitions) and run as a barrier stage (every task
    at once, or none: Spark needs that many free task slots). Each task writes its partition's ``features``
    (numeric columns, arrays of one length or Spark ML vectors; stacked like :func:`ddlf.datasets.parquet`, cast
    to ``dtype``) and ``label`` to shared memory and starts a ddlf worker beside it. Train a :class:`SparkApp`
    on the cluster; leaving the ``with`` block stops the workers and ends the stage. ``cluster_kwargs`` go to
    :class:`~ddlf.Cluster` (timeouts, heartbeats; ``token``, default one made for this stage, is the workers' too).
    Worker ``i`` holds partition ``i``.
    """
    from pyspark.sql.types import LongType, StructField, StructType

    features = [features] if isinstance(features, str) else list(features)
    n = int(num_workers or df.rdd.getNumPartitions())
    if n < 1:
        raise ConfigError(f"num_workers must be at least 1, not {n}")
    df = _vectors_to_arrays(df.select(*features, *([label] if label else [])))
    if df.rdd.getNumPartitions() != n:
        df = df.repartition(n)
    token = cluster_kwargs.pop("token", None) or secrets.token_urlsafe(24)
    spark_conf = df.sparkSession.sparkContext.getConf()
    driver_host = spark_conf.get("spark.driver.host", "127.0.0.1")
    server = socket.create_server(("", 0))
    server.settimeout(1.0)
    driver = (driver_host, server.getsockname()[1])
    kwargs = dict(
        features=features,
        label=label,
        dtype=dtype,
        token=token,
        driver=driver,
        worker_args=list(worker_args),
        start_timeout=start_timeout,
    )
    schema = StructType([StructField("partition", LongType()), StructField("rows", LongType())])
    failure: list[BaseException] = []

    def stage() -> None:
        try:
            df.mapInArrow(lambda it: _serve_partition(it, **kwargs), schema, barrier=True).collect()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=stage, name="ddlf-spark-stage", daemon=True)
    thread.start()
    conns: list[socket.socket] = []
    hellos: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + start_timeout
        while len(hellos) < n:
            if failure:
                hint = ""
                if "No module named 'ddlf'" in str(failure[0]):
                    hint = " (ddlf is not installed for the executors' Python: install it on every node, and set "
                    hint += "PYSPARK_PYTHON to that interpreter)"
                first = str(failure[0]).strip().splitlines()[:3]
                raise WorkerStartError(
                    f"the Spark stage hosting ddlf workers failed{hint}: {' '.join(first)}"
                ) from failure[0]
            if time.monotonic() > deadline:
                raise WorkerStartError(
                    f"{len(hellos)} of {n} ddlf workers started in Spark within {start_timeout:.0f} s (a barrier "
                    f"stage needs {n} free task slots at once)"
                )
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(30)
            line = conn.makefile("rb").readline()
            hello = json.loads(line)
            hellos[int(hello["partition"])] = hello
            conns.append(conn)
        cluster = Cluster([hellos[i]["address"] for i in range(n)], token, **cluster_kwargs)
        try:
            yield cluster
        finally:
            cluster.close()
    finally:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sendall(b"s")
                conn.close()
        server.close()
        thread.join(60)
