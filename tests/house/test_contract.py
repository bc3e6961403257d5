"""The launcher and the ranks talk through one written contract, and the parts of a rank are built whole.

* The project's own ``NANOTRON_RECOVER_*`` variables are read only by the launcher (``launcher/``) and the entry
  points (``train.py``, which reads the launch contract once: ``run/launch_contract.py``); every other read of the
  environment is a variable a library needs (Open MPI's rank, torch's rendezvous, wandb's mode), said on its line.
* No hand-written constructor takes more than 8 parameters (a dataclass is a record, not counted).
* The step's sums are read and written by name: no index counted by hand into the summed buffer.
* The regrow decision (the simulator's rule) is the launcher's: no rank-side module uses it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "nanotron_recover"
MAX_CONSTRUCTOR_PARAMETERS = 8


def _rank_side_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if "launcher" not in p.relative_to(PACKAGE).parts and p.name != "train.py"]


def _module(path: Path):
    return importlib.import_module(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))


def _reads_environ(node: ast.AST) -> ast.expr | None:
    """The key of a read of ``os.environ`` / ``os.getenv`` (``os.environ.get(k)``, ``os.environ[k]``,
    ``k in os.environ``, ``os.getenv(k)``), else None."""
    def is_environ(expr: ast.AST) -> bool:
        return isinstance(expr, ast.Attribute) and expr.attr == "environ" and getattr(expr.value, "id", "") == "os"

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        if (node.func.attr in ("get", "setdefault") and is_environ(node.func.value)) or \
                (node.func.attr == "getenv" and getattr(node.func.value, "id", "") == "os"):
            return node.args[0]
    if isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
        return node.slice
    if isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
        return node.left
    return None


def _key_value(key: ast.expr, path: Path) -> str | None:
    """The variable's name when the code can tell it (a literal, or a module-level constant)."""
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return key.value
    if isinstance(key, ast.Name):
        value = getattr(_module(path), key.id, None)
        return value if isinstance(value, str) else None
    return None


def test_the_projects_variables_are_read_only_by_the_launcher_and_the_entry_points() -> None:
    found = []
    for path in _rank_side_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            key = _reads_environ(node)
            name = _key_value(key, path) if key is not None else None
            if name is not None and name.startswith("NANOTRON_RECOVER_"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {name}")
    assert found == [], "read it at the entry point (run/launch_contract.py) and hand it down"


def test_every_other_read_of_the_environment_says_which_library_needs_it() -> None:
    found = []
    for path in _rank_side_modules():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if _reads_environ(node) is not None:
                here = lines[node.lineno - 1]
                before = lines[node.lineno - 2] if node.lineno > 1 else ""
                if "#" not in here and not before.strip().startswith("#"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {here.strip()}")
    assert found == []


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any((getattr(d, "id", None) or getattr(getattr(d, "func", None), "id", None)) == "dataclass"
               for d in node.decorator_list)


def test_no_hand_written_constructor_takes_more_than_8_parameters() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            for init in (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"):
                a = init.args
                count = len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                if count > MAX_CONSTRUCTOR_PARAMETERS and not _is_dataclass(cls):
                    found.append(f"{path.relative_to(ROOT)}:{init.lineno} {cls.name}.__init__ takes {count}")
    assert found == [], "group what travels together (a settings record), or hold an object instead of callbacks"


def test_the_step_sums_have_no_hand_counted_offsets() -> None:
    """An index into the summed buffer (``stats[...]``, ``buffer[...]``) is a name, never a number."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and getattr(node.value, "attr", None) in ("stats", "buffer") \
                    and (isinstance(node.slice, (ast.UnaryOp, ast.BinOp))
                         or (isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int))):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_the_regrow_decision_is_the_launchers() -> None:
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if "sim.regrow import" in p.read_text() or "import regrow" in p.read_text())
    assert all(u.startswith(("launcher/", "sim/")) for u in users), users
    assert "launcher/regrow.py" in users
