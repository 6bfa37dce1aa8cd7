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


def test_no_test_module_is_imported_by_another():
    """Shared test code lives in support modules (`helpers`, `references`,
    `rows`, `vr_cases`, `task_data`), not in test modules: a test module
    imported by another runs its module-level code twice and couples
    their private names."""
    found = []
    folder = os.path.join(ROOT, "tests")
    for folder_path, _, files in os.walk(folder):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder_path, file)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                for name in names:
                    if any(part.startswith("test_") for part in name.split(".")[1:]):
                        found.append(f"{os.path.relpath(path, ROOT)}: {name}")
    assert not found, found


def _application_files():
    """{name: parsed source} of the code that must use the library's public
    API only: the application (`tf_vrgd.experiments`), the Model Garden
    support (`tf_vrgd.model_garden`) and `scripts/`."""
    files = {}
    for folder in ("tf_vrgd/experiments", "tf_vrgd/model_garden", "scripts"):
        for file in sorted(os.listdir(os.path.join(ROOT, folder))):
            if file.endswith(".py"):
                path = os.path.join(ROOT, folder, file)
                with open(path) as f:
                    files[f"{folder}/{file}"] = ast.parse(f.read(), path)
    return files


def _is_library_private(module):
    """A private module of the library (`tf_vrgd._gsnr`), not of the
    application packages."""
    parts = module.split(".")
    return parts[0] == PACKAGE and any(p.startswith("_") and p != "__init__" for p in parts)


def _patches_and_private_overrides(tree, modules):
    """Assignments to a library module's attributes (monkeypatching) and
    private methods defined in subclasses of the library's classes."""
    package_names = {PACKAGE} | {m.rsplit(".", 1)[-1] for m in modules}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in package_names
                ):
                    found.append(f"{target.value.id}.{target.attr} = ...")
        if isinstance(node, ast.ClassDef):
            from_library = any(
                isinstance(base, ast.Attribute)
                and isinstance(base.value, ast.Name)
                and base.value.id in package_names
                for base in node.bases
            )
            for item in node.body if from_library else ():
                if (
                    isinstance(item, ast.FunctionDef)
                    and item.name.startswith("_")
                    and not item.name.startswith("__")
                ):
                    found.append(f"class {node.name}: def {item.name}")
    return found


def test_the_application_and_the_scripts_use_the_public_api_only():
    """No private module or name of the library, no library module's
    attribute reassigned, no private method of a library class overridden:
    what the application needs of the library is public."""
    modules = _modules()
    found = {}
    for name, tree in _application_files().items():
        imported, private = _imports(name, tree, modules)
        private += sorted(m for m in imported if _is_library_private(m))
        private += _patches_and_private_overrides(tree, modules)
        if private:
            found[name] = private
    assert not found, f"private modules or names used: {found}"


def test_the_hook_parts_read_no_private_name_another_module_defines():
    """Each part of the VR hook (`tf_vrgd/_gsnr*.py`) reads on `self` only
    the private names its own module defines, or Keras' optimizer does (the
    hooks Keras lets a subclass override): what another part keeps is
    reached through that part's public interface or an argument."""
    import keras

    trees = {}
    for file in sorted(os.listdir(os.path.join(ROOT, PACKAGE))):
        if file.endswith(".py"):
            with open(os.path.join(ROOT, PACKAGE, file)) as f:
                trees[file] = ast.parse(f.read(), file)
    defined = {file: _names_defined(tree) for file, tree in trees.items()}
    found = []
    for file, tree in trees.items():
        if not file.startswith("_gsnr"):
            continue
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and isinstance(node.ctx, ast.Load)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                continue
            name = node.attr
            if name in defined[file] or hasattr(keras.optimizers.Optimizer, name):
                continue
            others = sorted(other for other, names in defined.items() if name in names)
            if others:
                found.append(f"{file}:{node.lineno} self.{name} (defined in {', '.join(others)})")
    assert not found, found


def _names_defined(tree):
    """The names a module defines: its functions, classes and methods, class
    attributes, and the attributes its code assigns on `self`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                targets = []
                if isinstance(statement, ast.Assign):
                    targets = statement.targets
                elif isinstance(statement, ast.AnnAssign):
                    targets = [statement.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and isinstance(node.ctx, ast.Store)
        ):
            names.add(node.attr)
    return names
