"""Headless Chromium for screenshots of what ddlf shows a person (the HTML training report, ``ddlf status``):
used by ``scripts/screenshots.py`` and the observability tests. Not part of the installed package."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["find_chromium", "screenshot"]


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) binary on this machine, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome", "headless_shell"):
        found = shutil.which(name)
        if found:
            return found
    return None


def screenshot(
    html_path: str | os.PathLike[str],
    png_path: str | os.PathLike[str],
    *,
    width: int = 1200,
    height: int = 1600,
    timeout: float = 60.0,
) -> Path:
    """Render an HTML file (a report) to a PNG with headless Chromium, offline. Raises FileNotFoundError when
    no Chromium is installed, RuntimeError when it fails."""
    browser = find_chromium()
    if browser is None:
        raise FileNotFoundError("no chromium on PATH (Debian: apt-get install chromium)")
    png = Path(png_path).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    url = Path(html_path).resolve().as_uri()
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",  # root in a container has no user namespace for the sandbox
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        f"--window-size={width},{height}",
        f"--screenshot={png}",
        url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not png.exists():
        raise RuntimeError(f"chromium could not render {url}: {done.stderr.strip()[-500:]}")
    return png
