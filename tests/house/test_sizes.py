"""Sizes a newcomer can read: no function over 60 lines outside the tests, the step logic and the entry point
kept short (their limits are the house's, not a style guide's)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = {"src/nanotron_recover/recovery/resilient.py": 450, "src/nanotron_recover/train.py": 120}


def _long_functions(folder: Path) -> list[str]:
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_function_over_60_lines_outside_the_tests() -> None:
    assert [f for d in ("src", "benchmarks", "scripts") for f in _long_functions(ROOT / d)] == []


def test_the_step_logic_and_the_entry_point_stay_short() -> None:
    sizes = {name: len((ROOT / name).read_text().splitlines()) for name in MAX_FILE_LINES}
    assert {n: s for n, s in sizes.items() if s > MAX_FILE_LINES[n]} == {}
