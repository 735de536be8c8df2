"""GPUs on this host, as the worker daemons use them: which are visible, one per worker, and what each holds.

``ddlf-worker --gpu N`` makes only GPU ``N`` visible to its daemon (``CUDA_VISIBLE_DEVICES``, set before any
framework loads); ``Cluster.local(gpus="auto" | [ids])`` starts one such worker per GPU; ``ddlf status`` shows each
worker's device and its memory. Nothing here imports a framework: ``nvidia-smi`` answers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

from .errors import ConfigError


def parse_gpus(text: str) -> list[str]:
    """The GPU ids of a ``CUDA_VISIBLE_DEVICES``-style list (``"0,2"``); empty or ``"-1"``: none."""
    ids = [part.strip() for part in text.split(",")]
    if any(i == "-1" for i in ids):
        ids = ids[: ids.index("-1")]  # CUDA ignores everything from the first invalid id on
    return [i for i in ids if i]


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else every GPU ``nvidia-smi`` lists,
    else none."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return parse_gpus(env)
    return [row[0] for row in _query(["index"])]


def check_gpu_ids(text: str) -> str:
    """``ddlf-worker --gpu``: ``none``, or comma-separated GPU indices or UUIDs (``GPU-...``, ``MIG-...``), as
    ``CUDA_VISIBLE_DEVICES`` takes them. Returns the value for ``CUDA_VISIBLE_DEVICES``."""
    if text.strip().lower() == "none":
        return ""
    ids = [part.strip() for part in text.split(",")]
    bad = [i for i in ids if not (i.isdigit() or i.startswith(("GPU-", "MIG-")))]
    if not ids or bad:
        raise ConfigError(f"--gpu takes GPU indices (0 or 0,1), GPU-/MIG- UUIDs or 'none', got {text!r}")
    return ",".join(ids)


def choose_gpus(gpus: str | Sequence[int | str]) -> list[str]:
    """``Cluster.local``'s ``gpus``: ``"auto"`` (every visible GPU) or explicit ids; refuses an empty choice."""
    if isinstance(gpus, str):
        if gpus != "auto":
            raise ConfigError(f'gpus must be "auto" or a list of GPU ids, got {gpus!r}')
        found = visible_gpus()
        if not found:
            raise ConfigError(
                'gpus="auto" found no GPU (CUDA_VISIBLE_DEVICES is empty or nvidia-smi lists none): '
                "leave gpus out to train on CPU"
            )
        return found
    ids = [str(g).strip() for g in gpus]
    if not ids or any(not i or "," in i for i in ids):
        raise ConfigError(f"gpus must name at least one GPU id, got {list(gpus)!r}")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"gpus names a GPU twice: {ids}: one worker per GPU")
    return ids


def describe() -> str:
    """This worker's device, for ``ddlf status``: ``cpu``, or each visible GPU with its memory in use."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = parse_gpus(env) if env is not None else None
    if ids == []:
        return "cpu"
    rows = _query(["index", "name", "memory.used", "memory.total"], ids)
    if not rows:
        return f"gpu {','.join(ids)} (not found by nvidia-smi)" if ids else "cpu"
    return "; ".join(
        f"gpu {i} {name} ({float(used) / 1024:.1f}/{float(total) / 1024:.1f} GiB)" for i, name, used, total in rows
    )


def _query(fields: list[str], ids: Sequence[str] | None = None) -> list[list[str]]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    cmd = [smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
    if ids:
        cmd += ["-i", ",".join(ids)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[part.strip() for part in line.split(",")] for line in out.splitlines() if line.strip()]
