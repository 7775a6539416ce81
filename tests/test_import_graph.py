"""The packages' import graph has the layers the code layout promises.

Every ``import`` and ``from ... import`` of every module under ``services/`` and ``cachestore/`` is
read with ``ast`` (those inside functions too: an import deferred to call time is a dependency all
the same; relative imports resolved), and folded into a graph of packages: ``services.api.cli`` is
``api``, a module directly in ``services/`` (``services/cli.py``) is a node of its own, and
everything under ``cachestore/`` is ``cachestore``. Then:

- no cycle between the packages of ``services/`` (a face that imports another face that imports it
  back cannot be understood, tested or replaced alone);
- ``cachestore`` imports nothing of ``services`` (the store knows no model, no gRPC);
- ``runtime`` imports neither ``engine``, ``modelbuild`` nor ``cachestore`` (sessions and slots
  know nothing of scheduling, building or storing);
- ``engine`` imports nothing of ``api`` (the engine knows no gRPC);
- neither the project nor the tests import a benchmark (``bench``) module: what both need lives in
  the project;
- inside ``services/engine/`` every import runs one way between its rooms: engine -> input/output
  processors, KV connector, scheduler -> model runner -> what lies below them all.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT_PACKAGES = ("services", "cachestore")


@dataclass(frozen=True, slots=True)
class Import:
    """One imported module name, and where: ``path:line``."""

    module: str
    where: str


def module_name(path: Path, root: Path) -> str:
    """``services/api/cli.py`` -> ``services.api.cli``; a package's ``__init__.py`` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path, packages: tuple[str, ...] = PROJECT_PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` under ``root`` by dotted name."""
    return {module_name(path, root): path for top in packages for path in sorted((root / top).rglob("*.py"))}


def imports_of(path: Path, module: str, known: set[str], root: Path) -> list[Import]:
    """Every module that ``path`` (module ``module``) imports, at any depth of its code. ``from X
    import Y`` names ``X.Y`` when that is a module of ``known`` (a submodule), else ``X``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    where = path.relative_to(root)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, f"{where}:{node.lineno}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(sub if sub in known else base, f"{where}:{node.lineno}"))
    return list(dict.fromkeys(found))  # once per statement: `from X import a, b` names X once


def node_of(module: str) -> str | None:
    """The graph node of a module name: ``api`` for ``services.api.*``, ``cli`` for
    ``services.cli``, ``cachestore`` for ``cachestore.*``, ``bench`` for ``bench.*``; None for
    everything else (the standard library, third parties, the generated ``kvshare`` stubs, and the
    ``services`` package itself, which every module of it imports implicitly)."""
    parts = module.split(".")
    if parts[0] == "services":
        return parts[1] if len(parts) > 1 else None
    return parts[0] if parts[0] in ("cachestore", "bench", "tests") else None


def package_graph(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importer node, imported node) -> each import behind that edge, as ``path:line imports M``."""
    modules = project_modules(root)
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in modules.items():
        source = node_of(module)
        for imported in imports_of(path, module, set(modules), root):
            target = node_of(imported.module)
            if target is not None and target != source:
                edges[source, target].append(f"{imported.where} imports {imported.module}")
    return dict(edges)


def services_nodes(root: Path = ROOT) -> set[str]:
    return {node_of(m) for m in project_modules(root, ("services",))} - {None}


def tangles(edges: dict[tuple[str, str], list[str]], nodes: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one node among ``nodes`` (Tarjan's
    algorithm), each sorted: sets of packages that all reach one another through imports."""
    successors: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        if a in nodes and b in nodes:
            successors[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(successors[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return components


def shortest_cycle(component: list[str], edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """The shortest cycle through the component's first node inside it: a node list whose last
    node imports the first."""
    start, inside = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(b for a, b in edges if a == node):
                if nxt == start:
                    return paths[node]
                if nxt in inside and nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{component} holds no cycle")


def describe(component: list[str], edges: dict[tuple[str, str], list[str]]) -> str:
    """``api, local, route import one another (api -> local -> api)`` and, under it, every import
    between them, so that the message says which lines to change."""
    cycle = shortest_cycle(component, edges)
    lines = [f"{', '.join(component)} import one another ({' -> '.join([*cycle, cycle[0]])}):"]
    for (a, b), why in sorted(edges.items()):
        if a in component and b in component:
            lines += [f"  {a} -> {b}:"] + [f"    {w}" for w in why]
    return "\n".join(lines)


def test_no_cycle_between_the_packages_of_services():
    edges = package_graph()
    found = tangles(edges, services_nodes())
    assert not found, "import cycles between packages of services/:\n" + "\n".join(describe(c, edges) for c in found)


def test_no_forbidden_edge():
    edges = package_graph()
    # Edges that must not exist beyond the no-cycle rule: importer -> (what it must not import, why).
    rules = {
        "cachestore": (services_nodes(), "the store knows nothing of services/"),
        "runtime": ({"engine", "modelbuild", "cachestore"}, "runtime knows neither the engine, the builder nor the store"),
        "engine": ({"api"}, "the engine knows no gRPC face"),
    }
    broken = []
    for (a, b), why in sorted(edges.items()):
        if a in rules and b in rules[a][0]:
            broken.append(f"{a} -> {b} ({rules[a][1]}):\n" + "\n".join(f"    {w}" for w in why))
    assert not broken, "forbidden imports:\n" + "\n".join(broken)


def test_the_project_imports_no_benchmark_or_test_module():
    edges = package_graph()
    found = [f"{a} -> {b}: {w}" for (a, b), why in sorted(edges.items()) if b in ("bench", "tests") for w in why]
    assert not found, "the project imports benchmarks or tests:\n" + "\n".join(found)


def test_no_test_imports_a_benchmark_module():
    """What a test shares with a benchmark lives in the project (or, if tiny, in the test)."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        module = module_name(path, ROOT)
        for imported in imports_of(path, module, set(), ROOT):
            if node_of(imported.module) == "bench":
                found.append(f"{imported.where} imports {imported.module}")
    assert not found, "tests import benchmark modules:\n" + "\n".join(found)


def test_the_walker_sees_nested_and_relative_imports(tmp_path):
    """The checks above are only as good as the walker: imports inside functions and relative
    imports (``from ..x import y``, ``from . import z``) must all reach the graph."""
    pkg = tmp_path / "services"
    for folder in ("a", "b", "c"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("")
    (pkg / "a" / "one.py").write_text("def f():\n    from ..b import two\n    return two\n")
    (pkg / "b" / "two.py").write_text("from . import three\nclass K:\n    def m(self):\n        import services.c.four\n")
    (pkg / "b" / "three.py").write_text("")
    (pkg / "c" / "four.py").write_text("from services import top\nfrom ..a import one\n")
    (tmp_path / "cachestore").mkdir()
    modules = project_modules(tmp_path)
    seen = {m: [i.module for i in imports_of(p, m, set(modules), tmp_path)] for m, p in modules.items()}
    assert seen["services.a.one"] == ["services.b.two"]
    assert sorted(seen["services.b.two"]) == ["services.b.three", "services.c.four"]
    assert sorted(seen["services.c.four"]) == ["services.a.one", "services.top"]
    edges = package_graph(tmp_path)
    assert set(edges) == {("a", "b"), ("b", "c"), ("c", "top"), ("c", "a")}
    [component] = tangles(edges, services_nodes(tmp_path))
    assert component == ["a", "b", "c"]
    assert describe(component, edges).splitlines()[:3] == ["a, b, c import one another (a -> b -> c -> a):",
                                                           "  a -> b:", "    services/a/one.py:2 imports services.b.two"]


ENGINE_ROOMS = {
    "services.engine.engine": "engine",
    "services.engine.engine_options": "engine",
    "services.engine.model_front": "engine",
    "services.engine.input_processor": "processors",
    "services.engine.output_processor": "processors",
    "services.engine.scheduler": "scheduler",
    "services.engine.admission": "scheduler",
    "services.engine.runner": "runner",
}
"""The rooms of ``services/engine/`` (docs/design.md, "The rooms of the engine"); the KV connector's
modules are the room ``connector``, except its plain per-sequence state; every other module is
``shared``: data and mechanisms below every room (a sequence, its lifecycle, a step's plan)."""
ENGINE_ROOM_MAY_IMPORT = {
    "engine": {"processors", "connector", "scheduler", "runner", "shared"},
    "processors": {"shared"},
    "connector": {"shared"},
    "scheduler": {"runner", "shared"},
    "runner": {"shared"},
    "shared": {"shared"},
}
"""Every arrow runs one way: engine -> processors, connector, scheduler -> runner -> runtime."""


def engine_room(module: str) -> str | None:
    """The room of a module of ``services.engine`` (None outside the engine)."""
    if not module.startswith("services.engine."):
        return None
    if module.startswith("services.engine.kv_connector") and module != "services.engine.kv_connector.state":
        return "connector"
    return ENGINE_ROOMS.get(module, "shared")


def test_the_engine_rooms_import_one_way():
    """The scheduler plans and the runner runs; the connector and the processors know neither: a
    room that imported back from one above it would tie their tests and their threads together."""
    modules = project_modules(ROOT, ("services",))
    broken = []
    for module, path in modules.items():
        room = engine_room(module)
        if room is None:
            continue
        for imported in imports_of(path, module, set(modules), ROOT):
            target = engine_room(imported.module)
            if target is not None and target != room and target not in ENGINE_ROOM_MAY_IMPORT[room]:
                broken.append(f"{room} -> {target}: {imported.where} imports {imported.module}")
    assert not broken, "imports against the engine's layering:\n" + "\n".join(broken)
    assert engine_room("services.engine.kv_connector.worker_side") == "connector"
    assert engine_room("services.engine.lifecycle") == "shared"
    assert "scheduler" not in ENGINE_ROOM_MAY_IMPORT["runner"], "the runner never imports the planner"
