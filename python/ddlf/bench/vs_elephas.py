"""The DDLF paper's comparison: the paper's CNN on MNIST trained by elephas on Spark (``local[2]``), by ddlf sync
and by ddlf async on 2 local workers, runs interleaved in one invocation. Each run is a fresh process timed from
its start to its end (imports, Spark or worker start-up, loading the data, training, evaluating the test set), as
a user would time ``python train.py``.

elephas pins tensorflow<2.20 and numpy<2, so it lives in its own virtualenv (``.venv-elephas`` at the repository
root, made on first use from the package registry; Spark needs a Java runtime on the PATH).

    python -m ddlf.bench elephas --epochs 2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
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
        app.train(epochs=epochs, batch_size=batch, mode=mode, verbose=0)
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
    p = argparse.ArgumentParser(prog="python -m ddlf.bench elephas", description=__doc__)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds of every contender")
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
    env = dict(os.environ, PYSPARK_PYTHON=str(elephas_python), PYSPARK_DRIVER_PYTHON=str(elephas_python))
    elephas_env = dict(env, KERAS_BACKEND="tensorflow")  # importing ddlf set jax for this process's children
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    common = ["--epochs", str(args.epochs), "--batch", str(args.batch), "--workers", str(args.workers)]
    elephas = [str(elephas_python), str(JOB), "--data", "examples/data/mnist", *common]
    contenders = {"elephas sync (Spark local[2])": [*elephas, "--mode", "synchronous"]}
    if not args.no_async_elephas:
        contenders["elephas async (Spark local[2], HTTP parameter server)"] = [*elephas, "--mode", "asynchronous"]
    ddlf_cmd = [sys.executable, "-m", "ddlf.bench", "elephas", *common]
    contenders["ddlf sync, 2 local workers"] = [*ddlf_cmd, "--ddlf-job", "sync"]
    contenders["ddlf async, 2 local workers"] = [*ddlf_cmd, "--ddlf-job", "async"]

    walls: dict[str, list[float]] = {k: [] for k in contenders}
    fits: dict[str, list[float]] = {k: [] for k in contenders}
    accs: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(args.repeats):
        for name, cmd in contenders.items():
            wall, out = _run(cmd, elephas_env if name.startswith("elephas") else env)
            walls[name].append(wall)
            fits[name].append(out["fit"])
            accs[name].append(out["accuracy"])
            print(f"round {r + 1}: {name}: {wall:.1f} s, fit {out['fit']:.1f} s, accuracy {out['accuracy']:.4f}")

    base = next(iter(contenders))
    base_wall, base_fit = report.median(walls[base]), report.median(fits[base])
    rows = []
    for name in contenders:
        w, f = report.median(walls[name]), report.median(fits[name])
        rows.append(
            [
                name,
                f"{w:.1f}",
                f"{w / base_wall:.2f}x",
                f"{f / args.epochs:.1f}",
                f"{f / base_fit:.2f}x",
                " / ".join(f"{100 * a:.2f}%" for a in accs[name]),
            ]
        )
    ratio = report.median(walls["ddlf sync, 2 local workers"]) / base_wall
    body = "\n".join(
        [
            "## The paper's comparison: elephas on Spark vs ddlf (the paper's CNN on MNIST)",
            "",
            f"Command: `python -m ddlf.bench elephas --epochs {args.epochs} --repeats {args.repeats}`  ",
            f"Machine: {report.machine()}",
            "",
            f"Each run is a fresh process training {args.epochs} epochs of batch {args.batch} on {args.workers} "
            "local workers and evaluating the test set, timed from process start to exit; contenders interleaved, "
            f"{args.repeats} rounds, medians. elephas {ELEPHAS_REQUIREMENTS[0].split('==')[1]} runs in its own "
            "virtualenv (TensorFlow backend); ddlf runs the same model with Keras on JAX.",
            "",
            report.table(
                ["run", "wall s", "vs elephas sync", "s/epoch in fit", "fit vs elephas sync", "test accuracy"], rows
            ),
            "",
            f"Target (issue 5): a {args.epochs}-epoch run's wall time at most 0.8x elephas's; ddlf sync: {ratio:.2f}x.",
        ]
    )
    path = report.write_section("elephas", body)
    print(body)
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
