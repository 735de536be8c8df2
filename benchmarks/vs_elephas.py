"""The DDLF paper's comparison: the paper's CNN on MNIST trained by elephas on Spark (``local[2]``), by ddlf sync
and by ddlf async on 2 local workers, runs interleaved in one invocation. Each run is a fresh process timed from
its start to its end (imports, Spark or worker start-up, loading the data, training, evaluating the test set), as
a user would time ``python train.py``.

elephas pins tensorflow<2.20 and numpy<2, so it lives in its own virtualenv (``.venv-elephas`` at the repository
root, made on first use from the package registry; Spark needs a Java runtime on the PATH). ddlf's contenders run
in that virtualenv too, on the same TensorFlow backend, so both frameworks drive the same kernels: ddlf is built
from this tree into it at the start of every run (a wheel from the build cache). The single-process baseline is
the same model's ``model.fit`` in one process there; ``--jax`` adds ddlf on the project's default backend (Keras on
JAX, from this virtualenv).

    python -m benchmarks elephas --epochs 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import report

ELEPHAS_REQUIREMENTS = ["elephas==7.3.0", "tensorflow<2.20", "numpy<2", "pyspark<=4.0.0"]
JOB = Path(__file__).with_name("elephas_job.py")


def ensure_venv(path: Path) -> Path:
    """The elephas virtualenv's python, creating the virtualenv if it is missing."""
    python = path / "bin" / "python"
    if python.exists():
        return python
    if shutil.which("java") is None:
        raise SystemExit("Spark needs a Java runtime: install one (Debian: apt-get install openjdk-17-jre-headless)")
    print(f"creating {path} with {' '.join(ELEPHAS_REQUIREMENTS)} (once)", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(path)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *ELEPHAS_REQUIREMENTS], check=True)
    return python


def install_ddlf(python: Path) -> None:
    """Build ddlf from this tree (release wheel, from the build cache) and install it into ``python``'s
    environment, replacing any earlier build, so the run measures this tree's code."""
    maturin = Path(sys.executable).with_name("maturin")
    root = Path(__file__).resolve().parents[1]  # the repository root
    with tempfile.TemporaryDirectory() as out:
        print(f"building ddlf for {python}", flush=True)
        subprocess.run(
            [str(maturin), "build", "--release", "--quiet", "-i", str(python), "-o", out],
            check=True,
            cwd=root,
        )
        wheels = list(Path(out).glob("ddlf-*.whl"))
        subprocess.run([str(python), "-m", "pip", "install", "-q", "cloudpickle>=3.0"], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", *map(str, wheels)],
            check=True,
        )


def _ddlf_job(mode: str, epochs: int, batch: int, workers: int) -> None:
    """The ddlf side of one run (in its own process, like the elephas side)."""
    t0 = time.perf_counter()
    examples = os.path.join(os.getcwd(), "examples")
    sys.path.insert(0, examples)
    import ddlf
    import mnist_common as mc

    x_test, y_test = mc.test_data()
    with ddlf.Cluster.local(workers) as cluster:
        start = time.perf_counter() - t0
        app = mc.MnistApp(cluster)
        t_fit = time.perf_counter()
        app.train(epochs=epochs, batch_size=batch, strategy=ddlf.Asynchronous() if mode == "async" else None, verbose=0)
        fit = time.perf_counter() - t_fit
        _, acc = app.evaluate(x_test, y_test)
    print(json.dumps({"start": start, "fit": fit, "accuracy": float(acc)}), flush=True)


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, dict[str, float]]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    last = [line for line in out.stdout.splitlines() if line.startswith("{")][-1]
    return wall, json.loads(last)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks elephas", description=__doc__)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every contender")
    p.add_argument("--jax", action="store_true", help="also run ddlf on Keras/JAX from this virtualenv")
    p.add_argument("--venv", default=".venv-elephas", help="elephas's virtualenv (made if missing)")
    p.add_argument("--no-async-elephas", action="store_true", help="leave out elephas's asynchronous mode")
    p.add_argument("--ddlf-job", choices=["sync", "async"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ddlf_job:
        _ddlf_job(args.ddlf_job, args.epochs, args.batch, args.workers)
        return
    if not os.path.isdir("examples/data/mnist"):
        raise SystemExit("run from the repository root (examples/data/mnist is needed)")
    elephas_python = ensure_venv(Path(args.venv).absolute())
    install_ddlf(elephas_python)
    env = dict(os.environ, PYSPARK_PYTHON=str(elephas_python), PYSPARK_DRIVER_PYTHON=str(elephas_python))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tf_env = dict(env, KERAS_BACKEND="tensorflow")  # importing ddlf set jax for this process's children
    jax_env = dict(env, KERAS_BACKEND="jax")
    common = ["--epochs", str(args.epochs), "--batch", str(args.batch), "--workers", str(args.workers)]
    elephas = [str(elephas_python), str(JOB), "--data", "examples/data/mnist", *common]
    single = "single-process model.fit (TensorFlow)"
    e_sync, e_async = "elephas sync (Spark local[2])", "elephas async (Spark local[2], HTTP parameter server)"
    d_sync, d_async = "ddlf sync, 2 local workers (TensorFlow)", "ddlf async, 2 local workers (TensorFlow)"
    contenders: dict[str, tuple[list[str], dict[str, str]]] = {
        single: ([*elephas, "--mode", "single"], tf_env),
        e_sync: ([*elephas, "--mode", "synchronous"], tf_env),
    }
    if not args.no_async_elephas:
        contenders[e_async] = ([*elephas, "--mode", "asynchronous"], tf_env)
    ddlf_tf = [str(elephas_python), "-m", "benchmarks", "elephas", *common]
    contenders[d_sync] = ([*ddlf_tf, "--ddlf-job", "sync"], tf_env)
    contenders[d_async] = ([*ddlf_tf, "--ddlf-job", "async"], tf_env)
    if args.jax:
        ddlf_jax = [sys.executable, "-m", "benchmarks", "elephas", *common]
        contenders["ddlf sync, 2 local workers (Keras on JAX)"] = ([*ddlf_jax, "--ddlf-job", "sync"], jax_env)
        contenders["ddlf async, 2 local workers (Keras on JAX)"] = ([*ddlf_jax, "--ddlf-job", "async"], jax_env)

    walls: dict[str, list[float]] = {k: [] for k in contenders}
    fits: dict[str, list[float]] = {k: [] for k in contenders}
    accs: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(args.repeats):
        for name, (cmd, run_env) in contenders.items():
            wall, out = _run(cmd, run_env)
            walls[name].append(wall)
            fits[name].append(out["fit"])
            accs[name].append(out["accuracy"])
            print(f"round {r + 1}: {name}: {wall:.1f} s, fit {out['fit']:.1f} s, accuracy {out['accuracy']:.4f}")

    wall = {k: report.median(v) for k, v in walls.items()}
    fit = {k: report.median(v) for k, v in fits.items()}
    rows = []
    for name in contenders:
        rows.append(
            [
                name,
                f"{wall[name]:.1f}",
                f"{wall[name] / wall[e_sync]:.2f}x",
                f"{fit[name] / args.epochs:.1f}",
                f"{fit[name] / fit[single]:.2f}x",
                " / ".join(f"{100 * a:.2f}%" for a in accs[name]),
            ]
        )
    targets = [f"ddlf sync {wall[d_sync] / wall[e_sync]:.2f}x elephas sync's wall time"]
    if e_async in wall:
        targets.append(f"ddlf async {wall[d_async] / wall[e_async]:.2f}x elephas async's")
    body = "\n".join(
        [
            "## The paper's comparison: elephas on Spark vs ddlf (the paper's CNN on MNIST)",
            "",
            f"Command: `python -m benchmarks elephas --epochs {args.epochs} --repeats {args.repeats}"
            f"{' --jax' if args.jax else ''}`  ",
            f"Machine: {report.machine()}",
            "",
            f"Each run is a fresh process training {args.epochs} epochs of batch {args.batch} on {args.workers} "
            "local workers (the single-process baseline: one process) and evaluating the test set, timed from "
            f"process start to exit; contenders interleaved, {args.repeats} rounds, medians. elephas "
            f"{ELEPHAS_REQUIREMENTS[0].split('==')[1]} and ddlf run in elephas's virtualenv on the same TensorFlow "
            "backend (ddlf built from this tree into it); 's/epoch in fit' is the time inside the training call "
            "(elephas's `fit`, ddlf's `app.train`, Keras's `model.fit`) per epoch.",
            "",
            report.table(
                ["run", "wall s", "vs elephas sync", "s/epoch in fit", "fit vs single process", "test accuracy"],
                rows,
            ),
            "",
            f"Targets (issue 5): a {args.epochs}-epoch run's wall time at most 0.8x elephas's: "
            + "; ".join(targets)
            + f". ddlf sync's training time per epoch at most 1.02x single-process model.fit's: "
            f"{fit[d_sync] / fit[single]:.2f}x (elephas sync: {fit[e_sync] / fit[single]:.2f}x).",
        ]
    )
    path = report.write_section("elephas", body)
    print(body)
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
