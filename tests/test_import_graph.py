"""The package's import graph: no module circles, and callbacks never import the training loop.

Callbacks see the loop through :class:`~aitoolbox.torchtrain.callbacks.protocol.TrainLoopView` (the object handed to
them); the loop imports callbacks, never the other way round. A circle between modules makes import order matter and
hides which one is the lower layer. Only imports that run count: those under ``if TYPE_CHECKING:`` are annotations.
Imports inside functions count too: they run when the function does.
"""
import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import aitoolbox

PACKAGE_ROOT = Path(aitoolbox.__file__).parent


def _module_names() -> Dict[str, Path]:
    names = {}
    for path in PACKAGE_ROOT.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


class _RuntimeImports(ast.NodeVisitor):
    """The import statements of a module that run (those under ``if TYPE_CHECKING:`` left out)."""

    def __init__(self):
        self.statements: List[ast.stmt] = []

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.orelse:
                self.visit(statement)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.statements.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.statements.append(node)


def _imported(module: str, path: Path, statement: ast.stmt, modules: Dict[str, Path]) -> Iterator[str]:
    """The package modules ``statement`` imports (``from pkg import submodule`` names the submodule)."""
    if isinstance(statement, ast.Import):
        targets = [alias.name for alias in statement.names]
    else:
        base = statement.module or ""
        if statement.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[:len(package) - (statement.level - 1)]
            base = ".".join(package + ([statement.module] if statement.module else []))
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in statement.names]
    for target in targets:
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in modules and target != module:
            yield target


def import_graph() -> Dict[str, Set[str]]:
    """``{module: modules it imports at run time}`` over the aitoolbox package."""
    modules = _module_names()
    graph: Dict[str, Set[str]] = {}
    for module, path in modules.items():
        visitor = _RuntimeImports()
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        graph[module] = {target for statement in visitor.statements
                         for target in _imported(module, path, statement, modules)}
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: List[Tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
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
                    work.append((child, iter(sorted(graph.get(child, ())))))
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


def test_the_package_has_no_import_circles():
    assert circles(import_graph()) == []


def test_callbacks_do_not_import_the_training_loop():
    graph = import_graph()
    offending = sorted((module, target) for module, targets in graph.items()
                       if module.startswith("aitoolbox.torchtrain.callbacks")
                       for target in targets if target.startswith("aitoolbox.torchtrain.train_loop"))
    assert offending == [], ("callbacks reach the loop through TrainLoopView (callbacks/protocol.py), not by "
                             f"importing train_loop/: {offending}")


def test_the_circle_finder_finds_a_circle():
    """The check itself: a two-module and a three-module circle are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"g"}, "g": set()}
    assert sorted(circles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_the_graph_sees_imports_inside_functions_and_skips_type_checking_ones():
    graph = import_graph()
    # train_loop.py imports the loop's helpers at its top; a callback module names the loop under TYPE_CHECKING only.
    assert "aitoolbox.torchtrain.train_loop.run_state" in graph["aitoolbox.torchtrain.train_loop.train_loop"]
    assert "aitoolbox.torchtrain.train_loop.train_loop" not in graph["aitoolbox.torchtrain.callbacks.spike_rollback"]
    # An import inside a function counts: checkpoint_base's own.
    source = (PACKAGE_ROOT / "torchtrain" / "callbacks" / "spike_rollback.py").read_text(encoding="utf-8")
    assert "    from aitoolbox.torchtrain.callbacks.checkpoint_base import" in source
    assert "aitoolbox.torchtrain.callbacks.checkpoint_base" in graph["aitoolbox.torchtrain.callbacks.spike_rollback"]
