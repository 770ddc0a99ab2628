"""The package layout: fastspec's modules import each other without a cycle (module-level and function-level
imports alike: a lazy import hides a cycle at import time, not from a reader), the README's layout section
names every package and top-level module there is, and its layering diagram is the order the imports follow."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fastspec"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the fastspec modules it imports. `from pkg import sub` names the submodule, not the package
    (a package's __init__ runs before any of its submodules: that order is not a dependency)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    edges.add(sub if sub in paths else base)
        graph[name] = {e for e in edges if e in paths and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

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
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_readme_layout_names_every_area():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):].split("\n## ")[0]
    areas = sorted(p.name + "/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    missing = [a for a in areas + modules if not re.search(rf"\b{re.escape(a)}", layout)]
    assert missing == []


def area(module: str) -> str:
    """fastspec.engine.worker -> engine; fastspec.config -> config (a top-level module is an area of its own)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_area_imports_back_up():
    """Areas (packages and top-level modules) form layers: none imports an area that imports it back."""
    graph: dict[str, set[str]] = {}
    for module, imported in import_graph().items():
        edges = graph.setdefault(area(module), set())
        edges.update(area(m) for m in imported if area(m) not in (area(module), "__init__"))
    for a in graph:
        graph[a] &= set(graph)
    assert cycles(graph) == []


def test_module_names_do_not_collide_across_areas():
    names: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.stem, []).append(module_name(path))
    assert {n: m for n, m in names.items() if len(m) > 1} == {}


def test_comments_cite_nothing_outside_the_code():
    """Comments and docstrings say what the code does now: no issue numbers, design documents or benchmark runs."""
    cited = re.compile(r"\bissue \d+|\bseed \d{3}\b|reference §|§\d|\d-core (VM|Xeon|CPU|machine)|\bH[12]00\b")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in PACKAGE.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if cited.search(line)]
    assert found == []


def readme_floors() -> list[set[str]]:
    """The README's layering diagram, top floor first: `cli/  >  tune/ ... >  errors.py` -> [{"cli"}, {"tune"}, ...]."""
    readme = (ROOT / "README.md").read_text()
    diagram = readme[readme.index("Layering:"):].split("```")[1]
    return [{name.strip().removesuffix("/").removesuffix(".py") for name in floor.split(",")}
            for floor in diagram.replace("\n", " ").split(">") if floor.strip()]


def test_readme_layering_diagram_matches_the_imports():
    """Every area is on a floor of the README's diagram, and each imports only areas on floors below its own."""
    floors = readme_floors()
    floor = {a: i for i, names in enumerate(floors) for a in names}
    graph = import_graph()
    assert sorted({area(m) for m in graph} - {"__init__"} - set(floor)) == []
    upward = sorted(f"{m} -> {x}" for m, imported in graph.items() for x in imported
                    if area(m) != area(x) and "__init__" not in (area(m), area(x))
                    and floor[area(x)] <= floor[area(m)])
    assert upward == []
