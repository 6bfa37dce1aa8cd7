"""The package's import graph: no cycle, and no module reaching into another
module's private names (its `_name`s), so that each module's public names
are its whole interface to the others."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "tf_vrgd"


def _modules():
    """{dotted module name: parsed source} of every module of the package."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                name = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                name = name.removesuffix(".__init__")
                with open(path) as f:
                    modules[name] = ast.parse(f.read(), path)
    return modules


def _imports(name, tree, modules):
    """(modules `name` imports, private names it takes from other modules)."""
    imported, private = set(), []
    aliases = {}  # local name -> package module it refers to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    imported.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module in modules:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                if child in modules:  # `from tf_vrgd import config`
                    imported.add(child)
                    aliases[alias.asname or alias.name] = child
                else:
                    imported.add(node.module)
                    if alias.name.startswith("_") and node.module != name:
                        private.append(f"from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            private.append(f"{node.value.id}.{node.attr}")
    # A package's __init__ is imported with any of its modules; not an edge.
    imported.discard(PACKAGE)
    imported.discard(name)
    return imported, private


def test_no_import_cycle_and_no_private_name_across_modules():
    modules = _modules()
    graph, private = {}, {}
    for name, tree in modules.items():
        graph[name], taken = _imports(name, tree, modules)
        if taken:
            private[name] = taken
    assert not private, f"private names taken across modules: {private}"
    # Depth-first search for a cycle.
    state = {}

    def visit(node, path):
        state[node] = "open"
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "open":
                cycle = path[path.index(child) :] + [child]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if child not in state:
                visit(child, path + [child])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
