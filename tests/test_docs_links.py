"""README.md and docs/ point only at what the repository holds: every Markdown link resolves to a
file (and, with a #fragment, to a heading of it), and every repository path they name in prose or
code (`docs/...`, `bench/results/...`, `runtime/engine.py`, ...) exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a path under one of the repository's folders, as prose or code names it: `bench/results/latest.md`
FOLDERS = "kiln|frontend|ir|passes|backends|runtime|tests|bench|docs"
NAMED_PATH = re.compile(rf"(?<![\w./-])((?:{FOLDERS})/[\w./-]*\w)")
FENCE = re.compile(r"^(```|~~~)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            found.add(text.replace(" ", "-"))
    return found


def prose_and_code(page: Path) -> str:
    """The page's text without its URLs (a path inside a URL is another site's)."""
    return re.sub(r"https?://\S+", "", page.read_text())


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_inside_the_repository(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: outside the repository by design
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or ROOT not in (resolved, *resolved.parents):
            broken.append(f"{target} (no such file)")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target} (no heading #{fragment})")
    assert not broken, f"{page.name}: links that do not resolve: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_page_names_exists(page):
    named = set(NAMED_PATH.findall(prose_and_code(page)))
    # a glob or a placeholder stands for files, not one file
    missing = sorted(p for p in named if not any(c in p for c in "*[]") and not (ROOT / p.rstrip(".")).exists())
    assert not missing, f"{page.name} names paths the repository lacks: {missing}"


def test_the_checks_see_links_and_paths():
    """The patterns find what they are meant to (a broken pattern would pass every page)."""
    text = "[the runs](../bench/results/latest.md#runs): bench/results/latest.md, `runtime/engine.py`, docs/serving.md."
    assert LINK.findall(text) == ["../bench/results/latest.md#runs"]
    assert NAMED_PATH.findall(text) == ["bench/results/latest.md", "runtime/engine.py", "docs/serving.md"]
    assert "docs/architecture.md" in {str(p.relative_to(ROOT)) for p in PAGES}
