"""The import graph of ``omnidesk/``: no cycles, and floors that are only ever imported downwards.

The imports are read with ``ast`` from the source, every import statement counted, the ones
inside functions too (a lazy import is still a dependency: the CLI -> window -> remote ->
CLI circle ran through them).  The floors, lowest first::

    errors, features          shared errors; the log-mel features of the engine and the models
    engine                    frames, end of turn, the turn and duplex engines, timeline
    audio                     sound devices, capture path, echo cancellation, the live session
    models                    the families (one folder each) under their registry, models/families.py
    remote                    a vLLM-Omni server as an executor
    doctor, desktop, gui      what the user sees
    cli, __main__             the commands

A unit may import only the units its row of FLOORS names.  Inside models/, the registry is
the top: nothing else in models/ imports it (it imports the family folders, lazily), except
the model management that works through it (``ABOVE_REGISTRY``: downloads and the inventory).  A change
that needs another arrow has to argue with this table, not slip past it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "omnidesk"

# unit -> the units it may import (besides itself)
FLOORS: dict[str, set[str]] = {
    "errors": set(),
    "features": {"errors"},
    "engine": {"errors", "features"},
    "audio": {"errors", "features", "engine"},
    "models": {"errors", "features", "engine"},
    "remote": {"errors", "features", "engine", "audio", "models"},
    "doctor": {"errors", "features", "engine", "audio", "models"},
    "desktop": {"errors"},
    "gui": {"errors", "features", "engine", "audio", "models", "remote", "doctor", "desktop"},
    "cli": {"errors", "features", "engine", "audio", "models", "remote", "doctor", "desktop", "gui"},
    "__main__": {"cli"},
}
REGISTRY = "omnidesk.models.families"  # the top of models/: nothing under models/ imports it ...
ABOVE_REGISTRY = {"omnidesk.models.download", "omnidesk.models.inventory"}  # ... but what manages models through it


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``package`` (a package is its __init__)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (anywhere in its source)."""
    modules = module_files(package)
    root = package.name
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] != root:
                    continue
                while target not in modules and "." in target:  # `import omnidesk.x.y.Name` -> omnidesk.x.y
                    target = target.rpartition(".")[0]
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unit(module: str) -> str:
    """The floor a module belongs to: the first name under the package (``omnidesk.audio.vad`` -> audio)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def floor_breaks(graph: dict[str, set[str]], floors: dict[str, set[str]], registry: str | None = None,
                 above_registry: set[str] = frozenset()) -> list[str]:
    """Every import that goes against the floors table (or into the registry from below it)."""
    bad = []
    for source in sorted(graph):
        mine = unit(source)
        for target in sorted(graph[source]):
            theirs = unit(target)
            if theirs != mine and theirs not in floors.get(mine, set()):
                allowed = ", ".join(sorted(floors.get(mine, set()))) or "nothing"
                bad.append(f"{source} imports {target}: {mine} may import only {allowed}")
            elif target == registry and mine == unit(registry) and source != registry and source not in above_registry:
                bad.append(f"{source} imports the registry {registry}, which sits above it")
    return bad


def test_every_unit_of_the_package_has_a_row():
    units = {unit(m) for m in module_files(PACKAGE)} - {PACKAGE.name}
    assert units <= set(FLOORS), f"add a FLOORS row for {sorted(units - set(FLOORS))}"


def test_no_import_cycles():
    assert cycles(import_graph(PACKAGE)) == []


def test_imports_go_down_the_floors():
    assert floor_breaks(import_graph(PACKAGE), FLOORS, REGISTRY, ABOVE_REGISTRY) == []


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_planted_cycle_and_an_upward_import_are_caught(tmp_path):
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "from . import b\n",
        # the cycle closes inside a function and through a relative import two levels up
        "pkg/low/b.py": "def f():\n    from ..low.a import thing\n    return thing\n",
        "pkg/high.py": "import pkg.low.a\n",
        "pkg/low/c.py": "from pkg.high import x\n",  # goes up a floor
    })
    graph = import_graph(pkg)
    assert graph["pkg.low.a"] == {"pkg.low.b"} and graph["pkg.low.b"] == {"pkg.low.a"}
    assert cycles(graph) == [["pkg.low.a", "pkg.low.b"]]
    floors = {"low": set(), "high": {"low"}}
    assert floor_breaks(graph, floors) == ["pkg.low.c imports pkg.high: low may import only nothing"]
    # without the planted files the same checks pass
    (pkg / "low" / "b.py").write_text("")
    (pkg / "low" / "c.py").write_text("")
    graph = import_graph(pkg)
    assert cycles(graph) == [] and floor_breaks(graph, floors) == []


def test_the_registry_is_imported_only_from_above_it(tmp_path):
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/models/__init__.py": "",
        "pkg/models/registry.py": "def load():\n    from .fam import run\n",
        "pkg/models/fam.py": "from .registry import load\n",
        "pkg/models/inventory.py": "from .registry import load\n",
        "pkg/cli.py": "from pkg.models.registry import load\n",
    })
    graph = import_graph(pkg)
    breaks = floor_breaks(graph, {"models": set(), "cli": {"models"}}, "pkg.models.registry", {"pkg.models.inventory"})
    assert breaks == ["pkg.models.fam imports the registry pkg.models.registry, which sits above it"]


@pytest.mark.parametrize("rule", sorted(FLOORS))
def test_the_table_has_no_loops(rule):
    """A floor never may import a unit that may import it back (the table itself is one way)."""
    for other in FLOORS[rule]:
        assert rule not in FLOORS.get(other, set()), (rule, other)
