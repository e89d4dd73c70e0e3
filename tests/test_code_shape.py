"""The package keeps the shape a maintainer can read (issue 45's bounds), measured on the tree itself.

- no hand-written module over 700 lines, no function over 80 (generated gRPC modules aside);
- no import cycle between modules, counting imports inside functions and under ``TYPE_CHECKING``;
- every import points down the layers of docs/design.md ("Where code runs"): ``core/`` imports no server
  (proxy, worker, rm, colocated) and names none in a string, servers import no launcher, ``client/``
  imports no notebook code.

A failure names the module, the function or the cycle; docs/design.md ("Where code runs") says why.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pathways_nb"
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
SERVERS = ("pathways_nb.proxy", "pathways_nb.worker", "pathways_nb.rm", "pathways_nb.colocated")


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _imported(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package's modules an import statement of module ``name`` names (a package's submodule if it is one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _imported(name, node):
                while target and target not in MODULES:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
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


def test_no_module_is_over_700_lines():
    long = {name: path.read_text().count("\n") for name, path in MODULES.items()}
    assert {name: n for name, n in long.items() if n > MAX_MODULE_LINES} == {}


def test_no_function_is_over_80_lines():
    long = [
        f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno >= MAX_FUNCTION_LINES
    ]
    assert long == []


def test_no_import_cycle():
    assert _cycles(_edges()) == []


# The layers, lowest first (docs/design.md, "Where code runs"): a module imports only from its own layer or
# those below. The package's own __init__ (the public names, imported on first use) sits on top.
LAYERS = {
    "pathways_nb._version": 0,
    "pathways_nb.errors": 0,
    "pathways_nb.protocol": 0,
    "pathways_nb.rpc": 0,
    "pathways_nb.compat": 0,
    "pathways_nb.core": 1,
    "pathways_nb.proxy": 2,
    "pathways_nb.worker": 2,
    "pathways_nb.rm": 2,
    "pathways_nb.colocated": 2,
    "pathways_nb.launch": 3,
    "pathways_nb.deploy": 3,
    "pathways_nb.client": 4,
    "pathways_nb.pipeline": 4,
    "pathways_nb.notebook": 5,
    "pathways_nb.cli": 6,
    "pathways_nb.testing": 6,
    "pathways_nb": 6,
}


def _layer(module: str) -> int:
    owner = max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len)
    return LAYERS[owner]


def test_every_import_points_down_the_layers():
    upward = [
        f"{module} -> {target}"
        for module, targets in _edges().items()
        for target in targets
        if _layer(target) > _layer(module)
    ]
    assert upward == []


def test_core_names_no_server_module_in_a_string():
    named = [
        f"{name}: {node.value!r}"
        for name, tree in TREES.items()
        if name.startswith("pathways_nb.core")
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(SERVERS)
    ]
    assert named == []


@pytest.mark.parametrize(
    "edges, cycles",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
    ],
)
def test_the_cycle_finder_finds_cycles(edges, cycles):
    assert _cycles(edges) == cycles
