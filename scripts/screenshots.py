"""Make the README's pictures with the project's own commands: train the MNIST CNN on 2 local workers with
``report=``, screenshot the report in headless Chromium, and screenshot what ``ddlf status`` prints for the live
workers (and one dead address).

    .venv/bin/python scripts/screenshots.py        # writes docs/images/report.png and docs/images/status.png
"""

from __future__ import annotations

import html
import os
import subprocess
import sys
from pathlib import Path

import ddlf

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from chromium import screenshot  # noqa: E402
from mnist_common import MnistApp, test_data  # noqa: E402

OUT = ROOT / "docs" / "images"
TERMINAL = """<!doctype html><meta charset=utf-8><style>body{{margin:0;background:#1e1e1e}}
pre{{margin:0;padding:14px 18px;color:#ddd;font:13px/1.5 'DejaVu Sans Mono',monospace}}b{{color:#8ae234}}</style>
<pre><b>$ {command}</b>
{output}</pre>"""


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    work = OUT / "build"
    work.mkdir(exist_ok=True)
    x_test, y_test = test_data()
    with ddlf.Cluster.local(n_workers=2) as cluster:
        app = MnistApp(cluster)
        app.limit = 12_000
        app.dataset_key = "mnist-v1-first-12000"
        app.train(
            epochs=4,
            batch_size=64,
            validation_data=(x_test[:2000], y_test[:2000]),
            strategy=ddlf.ModelAveraging(every=25),
            run=ddlf.RunConfig(report=work / "report.html"),
        )
        screenshot(work / "report.html", OUT / "report.png", width=1200, height=1250)
        command = ["ddlf", "status", *cluster.addresses, "127.0.0.1:1"]
        env = {**os.environ, "DDLF_TOKEN": cluster._local.token}  # the local workers' token
        done = subprocess.run(
            [sys.executable, "-m", "ddlf.cli", *command[1:]], capture_output=True, text=True, env=env, timeout=60
        )
    page = work / "status.html"
    page.write_text(TERMINAL.format(command=html.escape(" ".join(command)), output=html.escape(done.stdout)))
    screenshot(page, OUT / "status.png", width=1200, height=130)
    for name in ("report.png", "status.png"):
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
