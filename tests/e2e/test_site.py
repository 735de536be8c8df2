"""The documentation site (``mkdocs.yml``): it builds in strict mode (a broken link or anchor, a page missing from
the nav, a reference entry or a docstring the API reference cannot render fails the build), every name of
``ddlf.__all__`` has a reference entry with a description, and the front page and ``GradientAveraging``'s entry
render in headless Chromium. The screenshots are kept in ``docs/images/build/`` (ignored by git and left out of
the site): ``site-front.png`` and ``site-gradient-averaging.png``."""

from __future__ import annotations

import html
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scripts.chromium import dump_dom, find_chromium, screenshot

import ddlf

from ..conftest import REPO as _REPO

REPO = Path(_REPO)
SHOTS = REPO / "docs" / "images" / "build"


def _required(what: str, found: bool) -> None:
    if not found:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have {what}: scripts/install.sh installs it")
        pytest.skip(f"no {what} on this machine (scripts/install.sh installs it)")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for the module's tests (under /tmp: Chromium opens files there)."""
    _required("mkdocs", importlib.util.find_spec("mkdocs") is not None)
    out = tmp_path_factory.mktemp("site")
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert warnings == []
    print(f"site built in {time.monotonic() - t0:.1f} s")
    return out


def test_the_site_builds_with_every_page(site: Path) -> None:
    pages = {str(p.relative_to(site)) for p in site.rglob("index.html")}
    expected = {
        f"{part}/{p.stem}/index.html"
        for part in ("guide", "reference")
        for p in (REPO / "docs" / part).glob("*.md")
        if p.stem != "index"
    }
    assert {"index.html", "guide/index.html", "reference/index.html", "BENCHMARKS/index.html"} <= pages
    assert expected <= pages
    # The front page is the README, its links mapped into the site.
    front = (site / "index.html").read_text()
    assert "./scripts/test.sh" in front
    assert 'href="guide/training/"' in front and 'href="BENCHMARKS/#' in front


def _public_objects() -> dict[str, set[str]]:
    """Each name of ``ddlf.__all__`` -> the anchors its entry may have: ``ddlf.NAME``, or where it is defined."""
    out = {}
    for name in ddlf.__all__:
        obj = getattr(ddlf, name)
        anchors = {f"ddlf.{name}"}
        if inspect.ismodule(obj):
            anchors.add(obj.__name__)
        elif inspect.isclass(obj) or inspect.isfunction(obj):
            anchors.add(f"{obj.__module__}.{obj.__qualname__}")
        out[name] = anchors
    return out


HEADING = r'<h\d id="(?P<id>[^"]+)" class="doc doc-heading">'
ENTRY = re.compile(HEADING + r"(?P<body>.*?)(?=" + HEADING.replace("?P<id>", "?:") + "|$)", re.S)


def _entries(site: Path) -> dict[str, str]:
    """Every entry of the API reference: its anchor -> the text of its description (signature, labels and bases
    left out)."""
    out = {}
    for page in (site / "reference").rglob("index.html"):
        for m in ENTRY.finditer(page.read_text()):
            contents = m["body"].split('class="doc doc-contents', 1)[-1]
            contents = re.sub(r'<div class="doc-signature.*?</div>', "", contents, flags=re.S)
            contents = re.sub(r"<p>Bases:.*?</p>", "", contents, flags=re.S)
            paragraphs = re.findall(r"<p>(.*?)</p>", contents, re.S)
            text = " ".join(html.unescape(re.sub(r"<[^>]+>", "", p)) for p in paragraphs)
            out[m["id"]] = " ".join(text.split())
    return out


def test_every_public_name_has_a_reference_entry_with_a_description(site: Path) -> None:
    entries = _entries(site)
    assert len(entries) > 100  # the reference is there: classes, their methods, the modules' functions
    missing = sorted(name for name, anchors in _public_objects().items() if not anchors & entries.keys())
    assert missing == [], f"ddlf.__all__ names without a reference entry: {missing}"
    empty = sorted(
        name for name, anchors in _public_objects().items() if not any(entries.get(a, "").strip() for a in anchors)
    )
    assert empty == [], f"reference entries without a description: {empty}"


def test_docstring_roles_become_links_or_code(site: Path) -> None:
    page = (site / "reference" / "strategies" / "index.html").read_text()
    assert ":class:" not in page and ":meth:" not in page and ":mod:" not in page
    # GradientAveraging's docstring says :class:`Ring`: a link to Ring's entry on the same page.
    ga = page.split('id="ddlf.GradientAveraging"', 1)[1].split('id="ddlf.ModelAveraging"', 1)[0]
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]*href="#ddlf\.Ring"', ga)


def test_the_front_page_and_an_api_page_render_in_chromium(site: Path) -> None:
    browser = find_chromium()
    _required("chromium", browser is not None)
    assert browser is not None
    api = site / "reference" / "strategies" / "index.html"
    dom = dump_dom(api)
    # The page as the browser parsed it holds the entry and its description.
    assert 'id="ddlf.GradientAveraging"' in dom and "Synchronous gradient averaging" in dom
    from PIL import Image

    for html_path, png in ((site / "index.html", "site-front.png"), (api, "site-gradient-averaging.png")):
        shot = screenshot(html_path, SHOTS / png, width=1280, height=1400)
        img = Image.open(shot).convert("RGB")
        assert img.size == (1280, 1400)
        colours = img.getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 50, f"{png}: a blank page"
        # The header bar is drawn in the theme's colour (an unstyled page would be white there).
        r, g, b = img.getpixel((640, 20))
        assert b > r + 40, f"{png}: no styled header ({r}, {g}, {b})"
