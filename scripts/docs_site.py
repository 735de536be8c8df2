"""The documentation site's glue, named twice in ``mkdocs.yml``: as MkDocs hooks and as a griffe extension.

- **Pages from outside docs/.** ``README.md`` is the site's front page, ``BENCHMARKS.md`` and ``RELIABILITY.md`` join
  it as they are (the benchmarks write them where they lie).
- **Links written for a checkout.** Every page links as it must on GitHub and in a checkout (``docs/guide/x.md``
  links ``../../BENCHMARKS.md``, the README links ``docs/guide/x.md``); here each relative link is resolved against
  the page's place in the repository and pointed at that file's place in the site. A link to a file that does not
  exist, or that is not in the site (a source file: name it in backticks instead), is a warning, which fails
  ``mkdocs build --strict``.
- **Sphinx roles in docstrings.** The package's docstrings write ``:class:`Ring``` (and ``:meth:``, ``:func:``,
  ``:mod:``...); the reference renders them as code linked to their entry when the target is in the reference, as
  plain code otherwise (a private helper, a module the reference leaves out).
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

import griffe

REPO = Path(__file__).resolve().parents[1]
DOCS = "docs"
OUTSIDE = {"README.md": "index.md", "BENCHMARKS.md": "BENCHMARKS.md", "RELIABILITY.md": "RELIABILITY.md"}
"""Repository files outside docs/ that are pages of the site: path in the repository -> path in the site."""

log = logging.getLogger("mkdocs.plugins.ddlf_docs")

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?P<text>!?\[[^\]\n]*\])\((?P<target>[^()\s]+)\)")


def repo_path(src_uri: str) -> str:
    """Where a page of the site lies in the repository."""
    for path, uri in OUTSIDE.items():
        if uri == src_uri:
            return path
    return f"{DOCS}/{src_uri}"


def site_path(path: str) -> str | None:
    """Where a repository file lies in the site, or None when it is not part of it."""
    if path in OUTSIDE:
        return OUTSIDE[path]
    if path.startswith(f"{DOCS}/"):
        return path[len(DOCS) + 1 :]
    return None


def map_links(markdown: str, src_uri: str) -> tuple[str, list[str]]:
    """``markdown`` (the page at ``src_uri`` in the site) with its relative links mapped from the repository's
    layout to the site's, and what is wrong with the links that cannot be mapped. Code blocks are left alone."""
    page = repo_path(src_uri)
    problems: list[str] = []

    def one(match: re.Match[str]) -> str:
        target = match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)  # a URL, an anchor on this page, an absolute path (mkdocs checks those)
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page), path))
        if not (REPO / resolved).exists():
            problems.append(f"{page} links {target}: {resolved} does not exist")
            return match.group(0)
        where = site_path(resolved)
        if where is None:
            problems.append(f"{page} links {target}: {resolved} is not in the site (name it in backticks)")
            return match.group(0)
        relative = posixpath.relpath(where, posixpath.dirname(src_uri) or ".")
        return f"{match['text']}({relative}{'#' + anchor if anchor else ''})"

    out: list[str] = []
    in_code = False
    for line in markdown.split("\n"):
        if FENCE.match(line.lstrip()):
            in_code = not in_code
        out.append(line if in_code else LINK.sub(one, line))
    return "\n".join(out), problems


# -- MkDocs hooks -----------------------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, uri in OUTSIDE.items():
        files.append(File.generated(config, uri, abs_src_path=str(REPO / path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    mapped, problems = map_links(markdown, page.file.src_uri)
    for problem in problems:
        log.warning(problem)
    return mapped


# -- griffe: Sphinx roles in docstrings ------------------------------------------------------------------------

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|data|attr|mod|exc|obj|const):`(?P<tilde>~?)\.?(?P<target>[\w.]+)`")


def _find(path: str, package: griffe.Module) -> griffe.Object | griffe.Alias | None:
    if path == package.path:
        return package
    if not path.startswith(f"{package.path}."):
        return None
    try:
        return package[path[len(package.path) + 1 :]]
    except Exception:  # no such member, or an alias that does not resolve: no link
        return None


def _resolve(target: str, where: griffe.Object, package: griffe.Module) -> str | None:
    """The canonical path of what ``target`` names in ``where``'s docstring (Sphinx's search: the object and its
    parents, then the package), or None."""
    candidates = [target] if target.startswith(f"{package.path}.") else []
    scope: griffe.Object | None = where
    while scope is not None:
        candidates.append(f"{scope.path}.{target}")
        scope = scope.parent
    candidates.append(f"{package.path}.{target}")
    for candidate in candidates:
        found = _find(candidate, package)
        if found is not None:
            try:
                return found.canonical_path
            except Exception:
                return candidate
    return None


def rewrite_roles(text: str, where: griffe.Object, package: griffe.Module) -> str:
    """``text`` with each Sphinx role as code, linked (an optional cross-reference: plain code where the
    reference has no entry for it) when it names an object of the package."""

    def one(match: re.Match[str]) -> str:
        target = match["target"]
        title = f"<code>{target.rsplit('.', 1)[-1] if match['tilde'] else target}</code>"
        found = _resolve(target, where, package)
        return f'<autoref identifier="{found}" optional>{title}</autoref>' if found else title

    return ROLE.sub(one, text)


def _objects(obj: griffe.Object) -> list[griffe.Object]:
    out = [obj]
    for member in obj.members.values():
        if not member.is_alias and isinstance(member, griffe.Object):
            out += _objects(member)
    return out


class SphinxRoles(griffe.Extension):
    """Sphinx roles of the package's docstrings as cross-references (see the module's docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = rewrite_roles(obj.docstring.value, obj, pkg)
