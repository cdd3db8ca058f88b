"""The import graph follows the dataflow: no package-level cycle, and the leaves (kernels,
core_algos, config) import no other jaxrl package. Imports are read with `ast`, those inside
functions included, so a cycle cannot hide in a function body."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "jaxrl"
LEAVES = ("jaxrl.kernels", "jaxrl.core_algos", "jaxrl.config")


def unit(module: str) -> str:
    """`jaxrl.models.hf_io` -> `jaxrl.models` (a subpackage or a top-level module)."""
    return ".".join(module.split(".")[:2])


def import_graph() -> dict[str, dict[str, list[str]]]:
    """Unit -> unit it imports -> the `file:line`s that do."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        source = unit(".".join(parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                target = unit(name)
                if name.startswith("jaxrl.") and target != source:
                    graph[source][target].append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    )
    return graph


def cycles(graph) -> list[list[str]]:
    """Every edge a -> b that b reaches back from, as [a, b, ..., a]."""
    found = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            path = _path(graph, b, a)
            if path:
                found.append([a, *path])
    return found


def _path(graph, start: str, goal: str) -> list[str] | None:
    stack, seen = [[start]], {start}
    while stack:
        path = stack.pop()
        if path[-1] == goal:
            return path
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt not in seen:
                seen.add(nxt)
                stack.append([*path, nxt])
    return None


def test_no_package_level_cycle():
    graph = import_graph()
    found = cycles(graph)
    where = {f"{c[0]} -> {c[1]}": graph[c[0]][c[1]][:3] for c in found}
    assert not found, f"import cycles: {[' -> '.join(c) for c in found]}; edges at {where}"


def test_leaves_import_no_other_package():
    graph = import_graph()
    edges = {leaf: dict(graph.get(leaf, {})) for leaf in LEAVES if graph.get(leaf)}
    assert not edges, f"leaf packages import others: {edges}"


def test_the_reader_sees_imports_inside_functions():
    # train.py imports the trainer only inside main() (after joining the processes)
    assert "jaxrl.trainer" in import_graph()["jaxrl.train"]
    assert cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == [
        ["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"],
    ]  # fmt: skip
