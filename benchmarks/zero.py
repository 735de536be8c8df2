"""Sharded optimizer state (ZeRO stage 1): what each worker holds with a 50 M-parameter model and Adam.

    .venv/bin/python -m benchmarks zero [--workers 1,2,4] [--steps 4] [--framework keras|torch]

An MLP of 1024 -> 4 x 4096 -> 10 (54.6 M float32 parameters, 218 MB; Adam's two moments 437 MB), trained with
:class:`ddlf.GradientAveraging` on ``n`` local workers (a Keras model, or with ``--framework torch`` the same
network as a :class:`ddlf.TorchModel` with ``torch.optim.Adam``), with the whole optimizer state on every worker
(*whole*) and with ``shard_optimizer=True`` (*sharded*), ``--steps`` steps of batch 8 per worker. Each case is a
fresh process; the figures are History's per-worker ones of the last round: the optimizer state a worker holds (the
bytes of its optimizer's variables) and the worker process's resident memory at the round's end (weights, gradients
and buffers included, the same in both settings), with the seconds per step. The target (issue 38): optimizer state
per worker at most ``1/n`` + 10% of the whole.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Any

import numpy as np

from . import report

WIDTH = 4096
DEPTH = 4
FEATURES = 1024
BATCH = 8


def _model(framework: str = "keras") -> Any:
    if framework == "torch":
        import torch

        from ddlf.models import TorchModel

        torch.manual_seed(0)
        widths = [FEATURES] + [WIDTH] * DEPTH
        layers: list[Any] = []
        for a, b in itertools.pairwise(widths):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        module = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))
        return TorchModel(module, lambda p: torch.optim.Adam(p, lr=1e-3), torch.nn.CrossEntropyLoss(), metrics=())
    import keras

    keras.utils.set_random_seed(0)
    stack: list[Any] = [keras.Input(shape=(FEATURES,))]
    stack += [keras.layers.Dense(WIDTH, activation="relu") for _ in range(DEPTH)]
    stack.append(keras.layers.Dense(10, activation="softmax"))
    model = keras.Sequential(stack)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def run_case(workers: int, sharded: bool, steps: int, framework: str = "keras") -> dict[str, Any]:
    """One case in this process: the per-worker figures of the last round."""
    import ddlf

    rows = workers * BATCH * steps

    class Big(ddlf.IApp):
        dataset_key = f"bench-zero-{rows}-{framework}"

        def load_dataset(self) -> Any:
            rng = np.random.default_rng(0)
            return rng.standard_normal((rows, FEATURES)).astype(np.float32), rng.integers(0, 10, rows)

        def create_model(self) -> Any:
            return _model(framework)

    with ddlf.Cluster.local(workers) as cluster:
        app = Big(cluster)
        app.model = app.create_model()
        params = int(app.model.count_params())
        strategy = ddlf.GradientAveraging(shard_optimizer=sharded)
        h = app.train(epochs=2, batch_size=BATCH, strategy=strategy, verbose=0)
    last = [s for s in h.stats if s.epoch == 1]
    return {
        "params": params,
        "state": [s.optimizer_state_bytes for s in last],
        "resident": [s.resident_bytes for s in last],
        "seconds_per_step": h.epoch_seconds[-1] / steps,
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks zero", description=__doc__)
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--framework", choices=("keras", "torch"), default="keras", help="the model's framework")
    p.add_argument("--section", default=None, help="the BENCHMARKS.md section (default: zero, zero-torch)")
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        n, setting = args.case.split(":")
        print(json.dumps(run_case(int(n), setting == "sharded", args.steps, args.framework)))
        return
    t0 = time.perf_counter()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    results: dict[tuple[int, str], dict[str, Any]] = {}
    for n in [int(w) for w in args.workers.split(",")]:
        for setting in ("whole", "sharded"):
            cmd = [sys.executable, "-m", "benchmarks.zero", "--case", f"{n}:{setting}", "--steps", str(args.steps)]
            cmd += ["--framework", args.framework]
            out = report.json_case(cmd, env)
            if "error" in out:
                sys.exit(f"case {n} {setting} failed: {out['error']}")
            results[(n, setting)] = out
            print(f"{n} workers, {setting}: {out}", flush=True)
    mb = 2**20
    rows = []
    for (n, setting), r in results.items():
        whole = max(results[(n, "whole")]["state"])
        state = max(r["state"])
        rows.append(
            [
                str(n),
                setting,
                f"{state / mb:.0f}",
                f"{state / whole:.3f}" if whole else "",
                f"{1 / n + 0.1:.3f}" if setting == "sharded" else "",
                f"{max(r['resident']) / mb:,.0f}",
                f"{r['seconds_per_step']:.2f}",
            ]
        )
    params = next(iter(results.values()))["params"]
    torch = args.framework == "torch"
    body = (
        f"## Sharded optimizer state{', ddlf.TorchModel' if torch else ''} (`python -m benchmarks zero`)\n\n"
        f"`python -m benchmarks zero --workers {args.workers} --steps {args.steps} --framework {args.framework}` · "
        f"{report.machine()} · "
        f"{time.perf_counter() - t0:.0f} s\n\n"
        f"An MLP of {FEATURES} -> {DEPTH} x {WIDTH} -> 10 ({params / 1e6:.1f} M float32 parameters), "
        + ("a `ddlf.TorchModel` with `torch.optim.Adam`, " if torch else "Keras, Adam, ")
        + f"`GradientAveraging` on n local workers at batch {BATCH}, {args.steps} steps per epoch, the last epoch's "
        "per-worker figures from History (the largest worker): the optimizer state a worker holds, as a share of "
        "the whole state (the target: at most 1/n + 10%), its process's resident memory at the round's end, and "
        "seconds per step. *whole*: every worker holds Adam's state for every weight; *sharded*: "
        "`shard_optimizer=True`.\n\n"
        + report.table(
            ["workers", "setting", "optimizer state MB", "of whole", "target", "resident MB", "s/step"], rows
        )
        + "\n"
    )
    print(body)
    report.write_section(args.section or ("zero-torch" if torch else "zero"), body)


if __name__ == "__main__":
    main(sys.argv[1:])
