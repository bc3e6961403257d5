"""The written interface of the fault-tolerant world (``ft.protocol.ReplicaWorld``) against the real world and
against the in-memory world that the step-logic tests drive the strategy with. No MPI is started: the classes
are read, not built."""

from __future__ import annotations

import ast
import inspect

import pytest

from nanotron_recover.ft.protocol import ReplicaWorld
from nanotron_recover.ft.world import FTWorld
from tests.recovery.test_resilient_logic import InMemoryWorld

# what the in-memory world stands in for: the step, its repair and the spare activation (no formation, start-up,
# hang monitor or shutdown: those are tested with real processes in tests/ft)
IN_STEP = {"rank", "epoch", "events", "active_replicas", "live_ranks", "starting", "evicted", "progress",
           "hang_monitor", "repair_hook", "replica", "local_rank", "pooled", "live_replicas", "allreduce_sum_",
           "bcast_", "agree", "repair", "set_active_replicas"}


def _protocol_members() -> set[str]:
    """The interface's attributes (annotations), properties and methods."""
    return {name for name in ReplicaWorld.__dict__ if not name.startswith("_")} | set(ReplicaWorld.__annotations__)


def _instance_attributes(cls: type) -> set[str]:
    """Names ``__init__`` assigns to ``self`` (read from its source)."""
    tree = ast.parse(inspect.getsource(cls))
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    targets = [t for node in ast.walk(init) if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]  # a, b = ...
    return {
        e.attr for e in flat if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"
    }


def _parameters(func: object) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(func).parameters.values()]


def _check(cls: type, names: set[str]) -> list[str]:
    problems, attributes = [], _instance_attributes(cls)
    for name in sorted(names):
        expected = ReplicaWorld.__dict__.get(name)
        found = inspect.getattr_static(cls, name, None)
        if found is None and name not in attributes:
            problems.append(f"{cls.__name__} lacks {name}")
        elif isinstance(expected, property) and not isinstance(found, property) and name not in attributes:
            problems.append(f"{cls.__name__}.{name} is not a property or attribute")
        elif inspect.isfunction(expected):
            if not inspect.isfunction(found):
                problems.append(f"{cls.__name__}.{name} is not a method")
            elif _parameters(found) != _parameters(expected):
                problems.append(f"{cls.__name__}.{name}{inspect.signature(found)} != {inspect.signature(expected)}")
    return problems


def test_the_real_world_has_every_member_of_the_interface() -> None:
    assert _check(FTWorld, _protocol_members()) == []


def test_the_in_memory_world_matches_the_interface_where_it_stands_in() -> None:
    assert _check(InMemoryWorld, IN_STEP & _protocol_members()) == []


def test_the_interface_names_what_the_in_memory_world_stands_in_for() -> None:
    assert IN_STEP - _protocol_members() == set()


@pytest.mark.parametrize("name", ["agree", "repair", "allreduce_sum_"])
def test_a_changed_signature_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(InMemoryWorld, name, lambda self, other_name=None: None)
    assert any(name in p for p in _check(InMemoryWorld, {name}))
