"""Train the DDLF paper's CNN on MNIST with synchronous parameter averaging on a local 2-worker cluster.

python examples/mnist_sync.py [--epochs 3] [--workers 2] [--batch-size 32] [--compression float16|topk]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mnist_common import run

if __name__ == "__main__":
    run("sync", __doc__)
