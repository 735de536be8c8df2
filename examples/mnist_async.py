"""Train the DDLF paper's CNN on MNIST asynchronously (each worker at its own pace) on a local 2-worker cluster.

python examples/mnist_async.py [--epochs 3] [--workers 2] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ddlf
from mnist_common import MnistApp, test_data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--mode", choices=["sync", "async"], default="async")
    p.add_argument("--compression", choices=["float16", "bfloat16"], default=None)
    p.add_argument("--save", default=None, help="save the trained model here (.keras)")
    args = p.parse_args()

    x_test, y_test = test_data()
    t0 = time.perf_counter()
    with ddlf.Cluster.local(n_workers=args.workers) as cluster:
        app = MnistApp(cluster)
        history = app.train(
            epochs=args.epochs,
            batch_size=args.batch_size,
            mode=args.mode,
            compression=args.compression,
            validation_data=(x_test, y_test),
        )
        loss, acc = app.evaluate(x_test, y_test)
        if args.save:
            app.model.save(args.save)
    print(f"train loss per epoch: {[round(v, 4) for v in history.history['loss']]}")
    print(
        f"test accuracy: {acc:.4f}  test loss: {loss:.4f}  ({args.mode}, {args.workers} workers, "
        f"{args.epochs} epochs, {time.perf_counter() - t0:.1f} s in all)"
    )


if __name__ == "__main__":
    main()
