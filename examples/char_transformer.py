"""Train a small decoder-only transformer, byte by byte, on the Python standard library's own source files.

    python examples/char_transformer.py [--strategy ga|zero|ma|single] [--workers 2] [--layers 4] [--width 256]

Real text that every machine with Python has: the ``.py`` files of the standard library (``sysconfig``'s
``stdlib`` path), read in sorted order, the first ``--mb`` megabytes of them; the last 5% is held out. Each row is
a window of ``--context`` bytes and the same window shifted by one (the next byte at every position). The model:
byte and position embeddings, ``--layers`` pre-norm blocks (causal multi-head attention, a GELU MLP four times as
wide), a final norm and a 256-way softmax; AdamW with linear warm-up and cosine decay.

``--strategy ga`` trains with :class:`ddlf.GradientAveraging` (every worker steps on the average of the workers'
gradients: one process at ``workers x batch``, exactly), ``zero`` the same with each worker holding the AdamW
state of its ``1/workers`` of the weights only (``shard_optimizer=True``), ``ma`` with
:class:`ddlf.ModelAveraging` every 10 batches, ``single`` with ``model.fit`` in this process at that global
batch. Printed: tokens per second per epoch, the training loss, and the held-out loss in bits per byte.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sysconfig
import time
from typing import Any

import numpy as np

import ddlf


def stdlib_text(megabytes: float) -> np.ndarray:
    """The first ``megabytes`` of the standard library's ``.py`` files, in sorted order, as bytes."""
    root = sysconfig.get_paths()["stdlib"]
    want = int(megabytes * 1e6)
    parts, got = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if os.sep + "site-packages" + os.sep in path:
            continue
        with open(path, "rb") as f:
            data = f.read()
        parts.append(data)
        got += len(data)
        if got >= want:
            break
    if not parts:
        raise FileNotFoundError(f"no .py files under the standard library's path {root}")
    return np.frombuffer(b"".join(parts)[:want], dtype=np.uint8)


def windows(text: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows of ``context`` bytes and, for each, the next byte at every position."""
    n = (len(text) - 1) // context
    x = text[: n * context].reshape(n, context)
    y = text[1 : n * context + 1].reshape(n, context)
    return x, y


def split(text: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Training text and the held-out last 5%."""
    cut = int(len(text) * 0.95)
    return text[:cut], text[cut:]


def build(layers: int, width: int, heads: int, context: int, learning_rate: float, steps: int) -> Any:
    """The compiled decoder-only transformer (see the module docs). ``steps``: optimizer steps of the whole run
    (the cosine decay's length; the first 5% warm up linearly)."""
    import keras
    from keras import layers as L

    tokens = keras.Input(shape=(context,), dtype="int32")
    h = L.Embedding(256, width)(tokens)
    positions = keras.ops.arange(context)
    h = h + L.Embedding(context, width)(positions)
    for _ in range(layers):
        a = L.LayerNormalization(epsilon=1e-5)(h)
        a = L.MultiHeadAttention(heads, width // heads)(a, a, use_causal_mask=True)
        h = h + a
        m = L.LayerNormalization(epsilon=1e-5)(h)
        m = L.Dense(4 * width, activation="gelu")(m)
        h = h + L.Dense(width)(m)
    logits = L.Dense(256)(L.LayerNormalization(epsilon=1e-5)(h))
    model = keras.Model(tokens, logits)
    warmup = max(1, steps // 20)
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, max(1, steps - warmup), warmup_target=learning_rate, warmup_steps=warmup
    )
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.01, global_clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class StdlibText(ddlf.IApp):
    """Each worker reads the text itself (every machine has it) and keeps the windows."""

    megabytes = 1.0
    context = 128
    shape = (4, 256, 4)  # layers, width, heads
    learning_rate = 1e-3
    steps = 1000

    def load_dataset(self) -> Any:
        train, _ = split(stdlib_text(self.megabytes))
        return windows(train, self.context)

    def preprocess(self, x: Any, y: Any) -> Any:
        return x.astype(np.int32), y.astype(np.int32)

    def create_model(self) -> Any:
        layers, width, heads = self.shape
        return build(layers, width, heads, self.context, self.learning_rate, self.steps)


def bits_per_byte(loss: float) -> float:
    return loss / math.log(2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=["ga", "zero", "ma", "single"], default="ga")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16, help="rows per worker per step")
    p.add_argument("--mb", type=float, default=1.0, help="megabytes of the standard library's source")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    args = p.parse_args()
    for name in ("workers", "epochs", "batch_size", "context", "layers", "width", "heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.mb <= 0 or args.learning_rate <= 0:
        p.error("--mb and --learning-rate must be positive")
    if args.width % args.heads:
        p.error(f"--width {args.width} must be a multiple of --heads {args.heads}")

    train, held = split(stdlib_text(args.mb))
    if len(train) < 2 * args.context or len(held) < args.context + 1:
        p.error(f"--mb {args.mb} gives too little text for windows of --context {args.context}")
    x, y = windows(train, args.context)
    xv, yv = windows(held, args.context)
    global_batch = args.batch_size * args.workers  # one process steps on what the workers step on together
    steps = args.epochs * max(1, len(x) // global_batch)
    StdlibText.megabytes, StdlibText.context = args.mb, args.context
    StdlibText.shape, StdlibText.learning_rate, StdlibText.steps = (
        (args.layers, args.width, args.heads),
        args.learning_rate,
        steps,
    )
    StdlibText.dataset_key = f"stdlib-text-{args.mb}-{args.context}"
    tokens = len(x) * args.context
    print(
        f"{len(train):,} bytes of the standard library's source ({len(x):,} windows of {args.context}), "
        f"{len(held):,} held out; {args.strategy}, global batch {global_batch}, {steps} steps",
        flush=True,
    )
    if args.strategy == "single":
        import keras

        model = build(args.layers, args.width, args.heads, args.context, args.learning_rate, steps)
        seconds: list[float] = []
        losses: list[float] = []

        class Timer(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
                self.t0 = time.perf_counter()

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                seconds.append(time.perf_counter() - self.t0)
                losses.append(float((logs or {})["loss"]))

        model.fit(
            x.astype(np.int32),
            y.astype(np.int32),
            batch_size=global_batch,
            epochs=args.epochs,
            callbacks=[Timer()],
            verbose=2,
        )
        held_loss = float(model.evaluate(xv.astype(np.int32), yv.astype(np.int32), verbose=0))
    else:
        strategy: Any = {
            "ga": ddlf.GradientAveraging(),
            "zero": ddlf.GradientAveraging(shard_optimizer=True),
            "ma": ddlf.ModelAveraging(every=10),
        }[args.strategy]
        with ddlf.Cluster.local(args.workers) as cluster:
            app = StdlibText(cluster)
            h = app.train(epochs=args.epochs, batch_size=args.batch_size, strategy=strategy, verbose=0)
            seconds, losses = list(h.epoch_seconds), [float(v) for v in h.history["loss"]]
            held_loss = float(app.evaluate(xv, yv, return_dict=True)["loss"])
    for epoch, (s, loss) in enumerate(zip(seconds, losses), 1):
        print(f"epoch {epoch}: {tokens / s:,.0f} tokens/s, loss {loss:.3f} ({bits_per_byte(loss):.2f} bits/byte)")
    print(f"held-out loss: {held_loss:.3f} ({bits_per_byte(held_loss):.2f} bits/byte)")


if __name__ == "__main__":
    main()
