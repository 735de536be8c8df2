"""Writing benchmark results into BENCHMARKS.md: one section per benchmark, replaced on each run."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def machine() -> str:
    """One line describing this machine and software."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f", {kb / 2**20:.0f} GiB RAM"
    except OSError:
        pass
    from ddlf import __version__

    return (
        f"{cpu}, {cores} cores{mem}; Linux {platform.release()}; Python {sys.version.split()[0]}; "
        f"ddlf {__version__}; {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}"
    )


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of samples, nearest-rank."""
    s = sorted(samples)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, round(q / 100 * (len(s) - 1))))
    return s[k]


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def default_path() -> Path:
    """BENCHMARKS.md at the repository root (the current directory when run from there)."""
    return Path(os.environ.get("DDLF_BENCHMARKS_MD", "BENCHMARKS.md"))


def write_section(name: str, body: str, path: Path | None = None) -> Path:
    """Replace (or append) the section for benchmark ``name`` in BENCHMARKS.md."""
    path = path or default_path()
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else _HEADER
    if start in text and end in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
    return path


_HEADER = """# Benchmarks

Every number here is written by a benchmark command (named in each section), with the machine it ran on and
the baseline measured side by side in the same run. Machines are shared and noisy: compare the ratios within a
section, not absolute times across sections or runs.
"""


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def json_case(cmd: Sequence[str], env: dict[str, str], timeout: float = 3600) -> dict[str, Any]:
    """Run one benchmark case in a fresh process and return the JSON object on its last line of output; on
    failure, ``{"error": <its last stderr line>}`` (its stderr's tail goes to ours)."""
    out = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-3000:])
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))
