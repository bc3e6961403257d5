"""The docs point only at what the repository has: every linked or named file exists, every link's anchor is a
heading of its page, and nothing cites a file from outside the repository (a clone has none)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a repository path named in backticks: `src/...`, `tests/x.py`, `scripts/...`, `benchmarks/x.py`, `configs/x.yaml`
NAMED = re.compile(r"`((?:src|tests|scripts|benchmarks|configs|docs)/[\w./-]+?)`")
OUTSIDE = re.compile(r"\b(DESIGN\.md|FACTS\.md|STYLE\.md|\.\./shared)\b")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_named_file_exists(page: Path) -> None:
    text = page.read_text()
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            missing.append(target)
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            missing.append(f"{target} (no such heading)")
    for named in NAMED.findall(text):
        candidate = named.split("::")[0].rstrip(".,:")
        if "<" in candidate or "*" in candidate or not (ROOT / candidate).exists():
            if "<" not in candidate and "*" not in candidate:
                missing.append(named)
    assert missing == []


def test_nothing_cites_a_file_outside_the_repository() -> None:
    sources = [*PAGES, *(ROOT / "src").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"),
               *(ROOT / "scripts").rglob("*.*")]
    cited = [f"{p.relative_to(ROOT)}: {m}" for p in sources if p.is_file()
             for m in OUTSIDE.findall(p.read_text(errors="replace"))]
    assert cited == []


def test_readme_is_a_first_screen() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_the_slug_matches_githubs() -> None:
    assert (_slug("Compound faults: only committed state is published")
            == "compound-faults-only-committed-state-is-published")
    assert (_slug("What was measured (2-core CPU machine, 2026-11-29)")
            == "what-was-measured-2-core-cpu-machine-2026-11-29")
