"""An image-folder dataset: ddlf's pipeline (files kept encoded, batches decoded on the Rust prefetch threads)
against Keras' own ``image_dataset_from_directory`` (tf.data, parallel decode, ``prefetch(AUTOTUNE)``) on the
same JPEG files, in the same run.

    .venv/bin/python -m benchmarks images [--images 3000] [--side 128] [--size 64] [--epochs 3]

``--images`` JPEG files of ``--side`` pixels (smooth colour fields with noise, as photos compress) in 10 class
folders; both pipelines decode and resize them to ``--size`` and train the same small CNN (Keras on TensorFlow,
batch 32, one process each, fresh processes, alternated). Reported: the steady epoch's time per step (median of
the epochs after the first), the first epoch, the supply rate (one epoch of batches decoded, no model) and, for
ddlf, the share of the training loop spent waiting for a batch.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

from . import report
from .backends import fit_epochs


def write_folder(root: str, images: int, side: int) -> int:
    """``images`` JPEG files in 10 class folders. Returns their total size in bytes."""
    from PIL import Image

    rng = np.random.default_rng(0)
    total = 0
    yy, xx = np.mgrid[0:side, 0:side] / side
    for i in range(images):
        label = i % 10
        d = os.path.join(root, f"class{label}")
        os.makedirs(d, exist_ok=True)
        base = np.stack([np.sin(xx * (label + 1) + c) * 100 + 128 for c in range(3)], axis=-1)
        px = np.clip(base + yy[..., None] * 40 + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, format="JPEG", quality=90)
        with open(os.path.join(d, f"{i:06d}.jpg"), "wb") as f:
            f.write(buf.getvalue())
        total += len(buf.getvalue())
    return total


def model(size: int) -> Any:
    import keras

    m = keras.Sequential(
        [
            keras.Input((size, size, 3)),
            keras.layers.Rescaling(1 / 255),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def case(which: str, path: str, images: int, size: int, epochs: int, batch: int) -> dict[str, Any]:
    """One contender in this (fresh) process: supply rate, then training epochs."""
    import keras

    steps = images // batch
    out: dict[str, Any] = {"case": which, "steps": steps}
    if which == "keras":
        import tensorflow as tf

        def dataset() -> Any:
            ds = keras.utils.image_dataset_from_directory(
                path, image_size=(size, size), batch_size=batch, shuffle=True, seed=0, verbose=False
            )
            return ds.prefetch(tf.data.AUTOTUNE)

        t0 = time.perf_counter()
        n = sum(int(bx.shape[0]) for bx, _ in dataset())
        out["supply_images_s"] = n / (time.perf_counter() - t0)
        train = dataset().repeat()
        waits = None
    else:
        import ddlf
        from ddlf import ops

        x, y = ddlf.datasets.image_folder(path, size=(size, size))
        t0 = time.perf_counter()
        n = sum(len(b[0]) for b in ops.BatchPipeline([x, y], np.arange(len(x)), batch, prefetch=4))
        out["supply_images_s"] = n / (time.perf_counter() - t0)
        waits = []

        def forever() -> Any:
            epoch = 0
            while True:
                order = ops.permutation(len(x), 0, epoch)
                pipe = ops.BatchPipeline([x, y], order, batch, prefetch=4, drop_last=True)
                yield from pipe
                waits.append(pipe.stats()["wait_seconds"])
                epoch += 1

        train = forever()
    m = model(size)
    if which == "ddlf-loop":
        # What a ddlf worker runs in each training round: the model's traced step over the Rust pipeline.
        from ddlf.training.replica.steppers import stepper_for

        stepper = stepper_for(m)
        times: list[float] = []
        for epoch in range(epochs):
            t0 = time.perf_counter()
            pipe = ops.BatchPipeline([x, y], ops.permutation(len(x), 0, epoch), batch, prefetch=4, drop_last=True)
            stepper.begin()
            for bx, by in pipe:
                stepper.step(bx, by)
            stepper.end()
            times.append(time.perf_counter() - t0)
            waits.append(pipe.stats()["wait_seconds"])
    else:
        times = fit_epochs(m, train, steps_per_epoch=steps, epochs=epochs, verbose=0)
    out["epoch_s"] = times
    out["steady_step_ms"] = report.median(times[1:]) / steps * 1e3
    if waits:
        out["wait_share"] = report.median(waits[1:] or waits) / report.median(times[1:])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks images", description=__doc__)
    p.add_argument("--images", type=int, default=3000)
    p.add_argument("--side", type=int, default=128, help="pixels per side of the JPEG files")
    p.add_argument("--size", type=int, default=64, help="pixels per side the images are resized to")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(case(args.case, args.path, args.images, args.size, args.epochs, args.batch)))
        return
    t_start = time.perf_counter()
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    with tempfile.TemporaryDirectory(prefix="ddlf-bench-images-") as d:
        nbytes = write_folder(d, args.images, args.side)
        runs: dict[str, list[dict[str, Any]]] = {"keras": [], "ddlf": [], "ddlf-loop": []}
        for r in range(args.repeats):
            order = ("keras", "ddlf", "ddlf-loop")
            for which in order if r % 2 == 0 else order[::-1]:
                cmd = [sys.executable, "-m", "benchmarks", "images", "--case", which, "--path", d]
                cmd += ["--images", str(args.images), "--size", str(args.size), "--epochs", str(args.epochs)]
                cmd += ["--batch", str(args.batch)]
                res = report.json_case(cmd, env)
                print(which, res, flush=True)
                runs[which].append(res)
    rows = []
    summary: dict[str, dict[str, float]] = {}
    contenders = (
        ("keras", "Keras `image_dataset_from_directory` + prefetch, `fit`"),
        ("ddlf", "ddlf `image_folder` batches, `fit` (a Python generator)"),
        ("ddlf-loop", "ddlf `image_folder`, a worker's training loop (traced step)"),
    )
    for which, label in contenders:
        ok = [r for r in runs[which] if "error" not in r]
        if not ok:
            rows.append([label, "failed: " + runs[which][0]["error"], "", "", ""])
            continue
        s = {
            "step_ms": report.median([r["steady_step_ms"] for r in ok]),
            "first_s": report.median([r["epoch_s"][0] for r in ok]),
            "supply": report.median([r["supply_images_s"] for r in ok]),
            "wait": report.median([r["wait_share"] for r in ok]) if "wait_share" in ok[0] else float("nan"),
        }
        summary[which] = s
        rows.append(
            [
                label,
                f"{s['step_ms']:.1f}",
                f"{s['first_s']:.2f}",
                f"{s['supply']:.0f}",
                "-" if np.isnan(s["wait"]) else f"{s['wait'] * 100:.1f}%",
            ]
        )

    def vs_keras(which: str, what: str) -> float:
        if which not in summary or "keras" not in summary:
            return float("nan")
        return summary[which][what] / summary["keras"][what]

    ratio, fit_ratio, supply_ratio = (
        vs_keras("ddlf-loop", "step_ms"),
        vs_keras("ddlf", "step_ms"),
        vs_keras("ddlf", "supply"),
    )
    print(f"ddlf / keras: step {ratio:.2f}x (worker loop), {fit_ratio:.2f}x (fit), supply {supply_ratio:.2f}x")
    body = "\n".join(
        [
            "## Image folders: ddlf's Rust decoding against Keras' `image_dataset_from_directory`",
            "",
            f"`python -m benchmarks images --images {args.images} --side {args.side} --size {args.size} "
            f"--epochs {args.epochs} --repeats {args.repeats}` · {report.machine()} · "
            f"{time.perf_counter() - t_start:.0f} s",
            "",
            f"{args.images} JPEG files of {args.side}x{args.side} ({nbytes / 1e6:.1f} MB) in 10 class folders, "
            f"decoded and resized to {args.size}x{args.size}; the same small CNN (Keras on TensorFlow, batch "
            f"{args.batch}) in one fresh process per contender, alternated, medians of {args.repeats}. *Step*: the "
            "steady epochs' time per step; *supply*: one epoch of batches with no model; *blocked*: the share of "
            "the steady epoch ddlf's loop waited for a batch.",
            "",
            report.table(["pipeline", "step ms", "first epoch s", "supply images/s", "blocked on data"], rows),
            "",
            f"ddlf / Keras: **{ratio:.2f}x** the time per step in a ddlf worker's loop, {fit_ratio:.2f}x through "
            f"`fit` on a generator (Keras' adapter for Python generators), {supply_ratio:.2f}x the supply rate.",
        ]
    )
    path = report.write_section("images", body)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
