"""Train the DDLF paper's CNN on MNIST asynchronously (each worker at its own pace) on a local 2-worker cluster.

python examples/mnist_async.py [--epochs 3] [--workers 2] [--batch-size 32] [--compression float16|topk]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mnist_common import run

if __name__ == "__main__":
    run("async", __doc__)
