"""Headless Chromium for screenshots of what ddlf shows a person (the HTML training report, ``ddlf status``):
used by ``scripts/screenshots.py`` and the observability tests. Not part of the installed package."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["dump_dom", "find_chromium", "screenshot"]


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
    done = _run(cmd, timeout)
    if done.returncode != 0 or not png.exists():
        raise RuntimeError(f"chromium could not render {url}: {done.stderr.strip()[-500:]}")
    return png


def dump_dom(html_path: str | os.PathLike[str], *, timeout: float = 60.0) -> str:
    """The DOM of an HTML file as headless Chromium parsed it (``--dump-dom``). Raises FileNotFoundError when no
    Chromium is installed, RuntimeError when it gives nothing."""
    browser = find_chromium()
    if browser is None:
        raise FileNotFoundError("no chromium on PATH (Debian: apt-get install chromium)")
    url = Path(html_path).resolve().as_uri()
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--dump-dom", url]
    for _ in range(2):  # a browser that starts and gives nothing at all (once, in a loaded CI run) is asked again
        done = _run(cmd, timeout)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout
    raise RuntimeError(f"chromium gave no DOM for {url} (exit {done.returncode}): {done.stderr.strip()[-500:]}")


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run Chromium with a profile of its own: two at once on one profile hand the page to the first, and the
    second exits with nothing (tests in parallel processes, a screenshot beside them)."""
    with tempfile.TemporaryDirectory(prefix="ddlf-chromium-") as profile:
        return subprocess.run(
            [cmd[0], f"--user-data-dir={profile}", *cmd[1:]], capture_output=True, text=True, timeout=timeout
        )
