"""A transformer on real text: ``examples/char_transformer.py`` in one process, with model averaging and with
gradient averaging, side by side.

    .venv/bin/python -m benchmarks lm [--workers 2] [--mb 0.25] [--layers 2] [--width 128] [--epochs 2]

Each strategy runs the example as a user would (its own process, ``Cluster.local`` for ddlf), on the same bytes
of the standard library's source, the same model and the same global batch (``workers x batch``). Reported:
tokens per second of the last epoch (the first includes compiling), the training loss per epoch, and the
held-out loss in bits per byte.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from . import report

STRATEGIES = ("single", "ma", "ga", "zero")
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "char_transformer.py")


def run(strategy: str, args: argparse.Namespace) -> dict[str, object]:
    """One strategy: the example's printed epochs and held-out loss."""
    cmd = [sys.executable, EXAMPLE, "--strategy", strategy, "--workers", str(args.workers), "--mb", str(args.mb)]
    cmd += ["--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads)]
    cmd += ["--context", str(args.context), "--batch-size", str(args.batch_size), "--epochs", str(args.epochs)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{strategy} failed: {out.stderr[-3000:]}")
    epochs = [
        (float(m.group(1).replace(",", "")), float(m.group(2)))
        for m in re.finditer(r"^epoch \d+: ([\d,]+) tokens/s, loss ([\d.]+)", out.stdout, re.M)
    ]
    held = re.search(r"held-out loss: [\d.]+ \(([\d.]+) bits/byte\)", out.stdout)
    if not epochs or held is None:
        raise RuntimeError(f"{strategy}: unexpected output {out.stdout[-2000:]}")
    return {"epochs": epochs, "held_bits": float(held.group(1))}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks lm", description=__doc__)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mb", type=float, default=0.25)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = {s: run(s, args) for s in STRATEGIES}
    base = results["single"]["epochs"][-1][0]  # type: ignore[index]
    rows = []
    for s, r in results.items():
        epochs = r["epochs"]
        assert isinstance(epochs, list)
        rate = epochs[-1][0]
        rows.append(
            [
                s,
                f"{rate:,.0f}",
                f"{rate / base:.2f}x",
                " / ".join(f"{loss:.3f}" for _, loss in epochs),
                f"{r['held_bits']:.2f}",
            ]
        )
    body = (
        "## A transformer on real text (`python -m benchmarks lm`)\n\n"
        f"`python -m benchmarks lm --workers {args.workers} --mb {args.mb} --layers {args.layers} --width "
        f"{args.width} --heads {args.heads} --context {args.context} --batch-size {args.batch_size} --epochs "
        f"{args.epochs}` · {report.machine()} · {time.perf_counter() - t0:.0f} s\n\n"
        "`examples/char_transformer.py`: a decoder-only transformer trained byte by byte on the first "
        f"{args.mb} MB of the Python standard library's `.py` files (5% held out), AdamW with warm-up and cosine "
        f"decay, global batch {args.workers * args.batch_size} in every case: *single* is `model.fit` in one "
        f"process, *ma* `ModelAveraging(every=10)`, *ga* `GradientAveraging()` and *zero* "
        f"`GradientAveraging(shard_optimizer=True)` (each worker holds 1/{args.workers} of AdamW's state) on "
        f"{args.workers} local workers. Tokens per second of the last epoch (the first compiles), the training "
        "loss per epoch, the "
        "held-out loss in bits per byte (8 for uniform bytes).\n\n"
        + report.table(["strategy", "tokens/s", "vs single", "loss per epoch", "held-out bits/byte"], rows)
        + "\n"
    )
    print(body)
    report.write_section("lm", body)


if __name__ == "__main__":
    main(sys.argv[1:])
