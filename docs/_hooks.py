"""MkDocs hook: links from a docs page to the repository's own files (configs, tests, benchmarks).

On GitHub `[configs/fsdp2.yaml](../configs/fsdp2.yaml)` opens the file; in the site that path is
outside `docs/`. Each such target that exists is copied into the site under `_repo/` and the link
pointed there, so the link works in both places. A target that does not exist is left alone for
MkDocs to report (a warning, which `--strict` turns into a failed build), and so is a link to a
Markdown file outside `docs/` (link the docs page instead).

Pages also name files by path in code spans (`tests/test_resume.py`, `benchmarks/bench.py`,
`tests/test_gpu.py::test_name`): a named file that does not exist, or a test not in its file, is a
warning too, so a renamed test cannot leave a page pointing at nothing.

The README is not part of the site, but its links into `docs/` and the repository are checked here
the same way (the file exists; an anchor in a docs page exists), and so are the paths it names.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
PREFIX = "_repo"
NAMED = re.compile(r"`((?:tests|benchmarks|lightning_ppo|configs|notebooks)/[\w./-]+?)(?:::(\w+))?`")
log = logging.getLogger("mkdocs.hooks.lightning_ppo")
RST_ROLE = re.compile(r":(?:meth|class|func|attr|mod|data|exc|obj):<code>([^<]*)")
_anchors: dict[str, set[str]] = {}  # docs page -> the ids its HTML holds


def _outside_target(page_uri: str, target: str, docs_dir: Path, root: Path) -> str | None:
    """The repository-relative path a page's link points to, if it leaves docs/ for a repo file."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
        return None
    resolved = (docs_dir / posixpath.dirname(page_uri) / target).resolve()
    try:
        resolved.relative_to(docs_dir)
        return None  # inside docs/: MkDocs checks it
    except ValueError:
        pass
    try:
        rel = resolved.relative_to(root)
    except ValueError:
        return None
    if resolved.suffix == ".md" or not resolved.is_file():
        return None
    return rel.as_posix()


def _targets(config) -> tuple[Path, Path]:
    docs_dir = Path(config["docs_dir"]).resolve()
    return docs_dir, Path(config["config_file_path"]).resolve().parent


def on_files(files, config):
    docs_dir, root = _targets(config)
    wanted: set[str] = set()
    for file in files.documentation_pages():
        text = FENCE.sub("", Path(file.abs_src_path).read_text(encoding="utf-8"))
        for match in LINK.finditer(text):
            rel = _outside_target(file.src_uri, match.group(1), docs_dir, root)
            if rel is not None:
                wanted.add(rel)
    for rel in sorted(wanted):
        files.append(File.generated(config, f"{PREFIX}/{rel}", abs_src_path=str(root / rel)))
    return files


def on_page_markdown(markdown, page, config, files):
    docs_dir, root = _targets(config)

    def point(match: re.Match) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        rel = _outside_target(page.file.src_uri, target, docs_dir, root)
        if rel is None:
            return match.group(0)
        here = posixpath.dirname(page.file.src_uri)
        return f"]({posixpath.relpath(f'{PREFIX}/{rel}', here or '.')}{anchor})"

    _check_named(page.file.src_uri, markdown, root)
    return LINK.sub(point, markdown)


def _check_named(where: str, markdown: str, root: Path) -> None:
    for match in NAMED.finditer(markdown):
        path, test = root / match.group(1), match.group(2)
        if not path.exists():
            log.warning("Doc file '%s' names `%s`, which does not exist", where, match.group(1))
        elif test and path.is_file() and not re.search(rf"def {test}\b", path.read_text(encoding="utf-8")):
            log.warning("Doc file '%s' names `%s`, which has no %s", where, match.group(1), test)


def _role_target(name: str) -> str:
    return name[1:].rsplit(".", 1)[-1] if name.startswith("~") else name


def on_page_content(html, page, config, files):
    # Docstrings cross-reference in Sphinx's roles (:meth:`score`, :class:`~pkg.Name`), which
    # Markdown leaves as text before a code span: keep the code span, drop the role and the `~`.
    html = RST_ROLE.sub(lambda m: "<code>" + _role_target(m.group(1)), html)
    _anchors[page.file.src_uri] = set(re.findall(r'id="([^"]+)"', html))
    return html


def on_post_build(config):
    docs_dir, root = _targets(config)
    readme = root / "README.md"
    if not readme.is_file():
        return
    text = readme.read_text(encoding="utf-8")
    _check_named("README.md", text, root)
    for match in LINK.finditer(FENCE.sub("", text)):
        target, anchor = match.group(1), (match.group(2) or "")[1:]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        path = (root / target).resolve()
        if not path.exists():
            log.warning("README.md links '%s', which does not exist", target)
            continue
        try:
            page = path.relative_to(docs_dir).as_posix()
        except ValueError:
            continue
        if anchor and page in _anchors and anchor not in _anchors[page]:
            log.warning("README.md links '%s#%s', but %s has no such anchor", target, anchor, page)
