"""The house's import graph: no circles, and no import from a lower layer to a higher one (read from the code's
own import statements, function-level and type-only imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "nanotron_recover"

# Each top-level module or package of nanotron_recover, bottom floor first. A unit may import units on its own
# floor or below, never above; a new unit must be given a floor here.
FLOORS: list[set[str]] = [
    {"run"},  # the run folder, exit codes, job shape, devices, phase names, /proc, a full disk, the output filter
    {"process", "workload", "nanotron_compat"},  # before MPI_Init (guard, watchdog, injector); the pure planner
    {"ft", "models", "data", "sim", "report"},  # layer 1 (ft), the model, the data, the simulator, the report
    {"config"},  # RecoverConfig and its fault_tolerance section
    {"training"},  # the step loop, the seam, the stock path, buckets, checkpoints, metrics, the training state
    {"snapshots"},  # node-local state snapshots and their schedule
    {"recovery"},  # layer 2 (uses layers 1 and 3)
    {"hsdp"},
    {"launcher"},  # the command line, mpirun, overrides, preflight, runs
    {"train"},  # a rank's entry point
    {"testbed"},  # tools to try faults on one machine
]
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """``module -> project modules it imports`` (``from a import b`` names module ``a.b`` when that is one)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    assert _circles(_imports()) == []


def test_every_unit_has_a_floor() -> None:
    units = {_unit(m) for m in _imports()} - {"__init__"}
    assert units - set(FLOOR) == set()


def test_no_import_climbs_to_a_higher_floor() -> None:
    climbs = [f"{a} -> {b}" for a, targets in _imports().items() for b in targets
              if _unit(a) in FLOOR and _unit(b) in FLOOR and FLOOR[_unit(a)] < FLOOR[_unit(b)]]
    assert climbs == []


def test_the_check_sees_a_circle_and_a_climb() -> None:
    graph = {"nanotron_recover.run.run_folder": {"nanotron_recover.launcher.launch"},
             "nanotron_recover.launcher.launch": {"nanotron_recover.run.run_folder"}}
    assert _circles(graph) == [["nanotron_recover.launcher.launch", "nanotron_recover.run.run_folder"]]
    assert FLOOR[_unit("nanotron_recover.run.run_folder")] < FLOOR[_unit("nanotron_recover.launcher.launch")]
    real = _imports()
    assert "nanotron_recover.run.run_folder" in real["nanotron_recover.launcher.launch"]  # the reader sees real imports
    assert "nanotron_recover.recovery.formation" in real["nanotron_recover.recovery.resilient"]  # relative ones too
    assert "nanotron_recover.ft.events" in real["nanotron_recover.ft.protocol"]
