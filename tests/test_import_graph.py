"""No import circle anywhere in the house: the import graph of sleuth/ and trainer/, read with `ast`.

Every import counts, wherever it sits: at module level, inside a function (a deferred import only hides
a circle until the first call), and under `if TYPE_CHECKING:` (a type the other module needs is still a
dependency on it). A circle is broken by moving the shared piece into a module of its own (as RunInfo,
DataError, TargetError and check_target_fidelity were), not by deferring an import.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("sleuth", "trainer")


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _where(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    current = parents.get(node)
    while current is not None:
        if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return "function-level"
        if isinstance(current, ast.If) and "TYPE_CHECKING" in ast.unparse(current.test):
            return "type-checking"
        current = parents.get(current)
    return "module-level"


def import_graph(root: Path) -> dict[str, dict[str, str]]:
    """module -> {imported module of the house: where the first such import sits}."""
    known = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                # `from pkg import sub` imports the submodule when there is one, else a name of pkg
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            else:
                continue
            for name in names:
                target = resolve(name)
                if target and target != module:
                    graph.setdefault(module, {}).setdefault(target, _where(node, parents))
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle_in_sleuth_or_trainer():
    graph = import_graph(REPO)
    assert len(graph) > 50  # the graph was really built
    circles = cycles(graph)
    described = [" ; ".join(f"{a} -> {b} ({graph[a][b]})" for a in circle for b in sorted(graph.get(a, {})) if b in circle)
                 for circle in circles]
    assert not circles, "\n".join(described)


def test_the_cycle_finder_finds_a_circle_through_a_deferred_import(tmp_path: Path):
    (tmp_path / "sleuth").mkdir()
    (tmp_path / "trainer").mkdir()
    (tmp_path / "sleuth" / "__init__.py").write_text("")
    (tmp_path / "sleuth" / "a.py").write_text("from sleuth.b import thing\n")
    (tmp_path / "sleuth" / "b.py").write_text("def thing():\n    from sleuth import a\n")
    (tmp_path / "trainer" / "__init__.py").write_text("")
    (tmp_path / "trainer" / "c.py").write_text("from . import d\n")
    (tmp_path / "trainer" / "d.py").write_text("import os\n")
    graph = import_graph(tmp_path)
    assert graph["sleuth.b"] == {"sleuth.a": "function-level"}
    assert graph["trainer.c"] == {"trainer.d": "module-level"}
    assert cycles(graph) == [["sleuth.a", "sleuth.b"]]


def test_sleuth_never_imports_trainer():
    graph = import_graph(REPO)
    offending = {m: sorted(t for t in targets if t.split(".")[0] == "trainer")
                 for m, targets in graph.items() if m.split(".")[0] == "sleuth"}
    assert not {m: t for m, t in offending.items() if t}
