"""The package's modules import one another without cycles.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import`` of a
module of ``robust_attn``, also those inside functions (a cycle hidden in a function is still a
cycle), except those under ``if TYPE_CHECKING:`` (never run). An edge goes to the module named,
or to ``package.name`` where ``name`` is a submodule; importing ``a.b.c`` is not counted as an
import of the packages ``a`` and ``a.b``. Self-registration does not show here: a registry
(:class:`robust_attn.utils.plugins.Registry`) imports its package's modules with ``importlib``,
which is no edge, so a plug-in module may import its registry from the package's ``__init__``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "robust_attn"


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's ``__init__``)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _known(name: str, modules) -> str | None:
    """``name`` or its longest prefix that is a module of the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    graph = {}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        here = name if is_package else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps |= {_known(alias.name, modules) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[:len(here.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    deps.add(full if full in modules else _known(target, modules))
        graph[name] = {d for d in deps if d and d != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as one cycle
    through it (a path ``a -> b -> ... -> a``)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, c) for c in components]


def _cycle_in(graph, component: set[str]) -> list[str]:
    """A shortest cycle through the first module of ``component`` (breadth-first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_the_package_has_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle_inside_a_function_and_ignores_type_checking(tmp_path):
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from robust_attn.sub.a import f\n")
    (package / "sub" / "a.py").write_text("def f():\n    from robust_attn.sub import b\n")
    (package / "sub" / "b.py").write_text("from . import a\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from robust_attn import d\n")
    (package / "d.py").write_text("import robust_attn.c\n")
    graph = import_graph(tmp_path)
    assert graph["robust_attn.sub"] == {"robust_attn.sub.a"}
    assert graph["robust_attn.sub.a"] == {"robust_attn.sub.b"}
    assert graph["robust_attn.sub.b"] == {"robust_attn.sub.a"}
    assert graph["robust_attn.c"] == set()
    assert find_cycles(graph) == [["robust_attn.sub.a", "robust_attn.sub.b", "robust_attn.sub.a"]]


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c", "a"]]),
    ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
])
def test_find_cycles_on_small_graphs(edges, expected):
    assert find_cycles(edges) == expected
