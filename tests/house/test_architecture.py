"""docs/architecture.md's layout is the tree: every package and every module of ``nanotron_recover`` is listed under
its package, nothing listed is missing, at most three modules sit at the root, and a file name used in two packages
is one the docs explain."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "nanotron_recover"
DOC = ROOT / "docs" / "architecture.md"
ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[\w.]+/?)(?:\s|$)")


def _tree() -> dict[str, set[str]]:
    """``package -> its modules`` ("" for the root), read from the files."""
    tree: dict[str, set[str]] = {"": {p.name for p in PACKAGE.glob("*.py")}}
    for init in PACKAGE.glob("*/__init__.py"):
        tree[init.parent.name] = {p.name for p in init.parent.glob("*.py")} - {"__init__.py"}
    return tree


def _listed() -> dict[str, set[str]]:
    """``package -> its modules`` as the layout block of docs/architecture.md lists them."""
    text = DOC.read_text()
    block = text[text.index("## Layout"):].split("```")[1]
    lines = block.splitlines()
    start = lines.index("src/nanotron_recover/")
    listed: dict[str, set[str]] = {"": set()}
    package = ""
    for line in lines[start + 1:]:
        match = ENTRY.match(line)
        if not match or not match["indent"]:
            break  # the next top-level entry (tests/, benchmarks/): the package's list is over
        name, depth = match["name"], len(match["indent"])
        if depth == 2 and name.endswith("/"):
            package = name[:-1]
            listed[package] = set()
        elif depth == 2:
            package = ""
            listed[""].add(name)
        elif depth == 4:
            listed[package].add(name)
    return listed


def _explained_twins() -> set[str]:
    text = DOC.read_text()
    section = text[text.index("### Same names in two packages"):]
    return set(re.findall(r"`(\w+/\w+\.py)`", section))


def test_the_layout_lists_every_package_and_module() -> None:
    tree, listed = _tree(), _listed()
    assert sorted(set(tree) - set(listed)) == [], "packages missing from docs/architecture.md"
    assert sorted(set(listed) - set(tree)) == [], "packages listed in docs/architecture.md that do not exist"
    missing = sorted(f"{p}/{m}".lstrip("/") for p in tree for m in tree[p] - listed[p])
    stale = sorted(f"{p}/{m}".lstrip("/") for p in listed for m in listed[p] - tree.get(p, set()))
    assert missing == [], "modules missing from docs/architecture.md"
    assert stale == [], "modules listed in docs/architecture.md that do not exist"


def test_at_most_three_modules_at_the_root() -> None:
    assert len(_tree()[""]) <= 3


def test_a_name_in_two_packages_is_explained() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for package, modules in _tree().items():
        for module in modules - {"__init__.py", "__main__.py"}:
            where[module].append(f"{package}/{module}" if package else module)
    twins = {path for paths in where.values() if len(paths) > 1 for path in paths}
    assert sorted(twins - _explained_twins()) == []


def test_the_reader_sees_the_layout() -> None:
    listed = _listed()
    assert {"config.py", "train.py"} <= listed[""]
    assert "state_transfer.py" in listed["recovery"] and "hang.py" in listed["ft"]
    assert "launch.py" in listed["launcher"]
