"""The package's shape: one folder per layer, imports only downwards, no import circle.

The import graph is read from the source (every `import` statement, at module level
or inside a function alike), so an import hidden in a function counts as much as one
at the top of a module. `from kerasps.x import y` is an import of the module
`kerasps.x.y` where that is a module, else of `kerasps.x`.
"""

import ast
import collections
import pathlib
import sys

import pytest

import kerasps

ROOT = pathlib.Path(kerasps.__file__).parent

# Bottom to top; a module may import its own layer and the layers below it.
LAYERS = (
    ("kerasps.policy", "pure Python policies, no TensorFlow (the simulator's dependency)"),
    ("kerasps.backend", "the only modules on TensorFlow internals and Keras-private APIs"),
    ("kerasps.runtime", "TensorFlow cluster runtime: cluster, coordinator, input"),
    ("kerasps.params", "sharded variables and row updates"),
    ("kerasps.keras", "Keras integration: installer, trainer, callbacks, layers"),
    ("kerasps.api", "the public API: kerasps/__init__.py and kerasps/strategy.py"),
    ("kerasps.ops", "operating a cluster: CLI, launcher, manifests, demo"),
)
_API = {"kerasps", "kerasps.strategy"}


def modules(root: pathlib.Path, package: str) -> dict:
    """Dotted module name -> path, for every module of the package at `root`."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph(root: pathlib.Path, package: str) -> dict:
    """Module -> {(imported module, line)}: every import statement of the package's
    modules that names one of its modules, wherever in the module it is."""
    mods = modules(root, package)

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = collections.defaultdict(set)
    for name, path in mods.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                if target == package or target.startswith(package + "."):
                    graph[name].add((target, node.lineno))
    return {name: {(resolve(t), t, line) for t, line in edges} for name, edges in graph.items()}


def circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    edges = {name: {target for target, _, _ in targets if target and target != name}
             for name, targets in graph.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def layer_of(name: str) -> int | None:
    if name in _API:
        return [layer for layer, _ in LAYERS].index("kerasps.api")
    for rank, (layer, _) in enumerate(LAYERS):
        if name == layer or name.startswith(layer + "."):
            return rank
    return None


def upward_imports(graph: dict) -> list:
    return [f"{name} imports {target} (line {line})"
            for name, targets in sorted(graph.items()) for target, _, line in sorted(targets)
            if target and layer_of(target) > layer_of(name)]


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT, "kerasps")


def test_every_module_is_in_a_layer():
    assert [name for name in modules(ROOT, "kerasps") if layer_of(name) is None] == []


def test_no_import_circle(graph):
    assert circles(graph) == []


def test_imports_go_down_the_layers(graph):
    assert upward_imports(graph) == []


def test_modules_import_where_modules_live_not_their_aliases(graph):
    # `kerasps.cluster` is an alias for programs (kerasps/__init__.py); inside the
    # package an import names the module's folder, so that the graph shows the layers.
    aliased = [f"{name} imports {written} (line {line})"
               for name, targets in sorted(graph.items()) for _, written, line in sorted(targets)
               if kerasps._moved_to(written)]
    assert aliased == []


def _imported(path: pathlib.Path) -> list:
    """The names of the modules a file imports (any depth), third-party ones included."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.append(node.module or "")
    return names


def test_policies_import_no_tensorflow():
    for name, path in modules(ROOT, "kerasps").items():
        if layer_of(name) == 0:
            assert [n for n in _imported(path)
                    if n.split(".")[0] in ("tensorflow", "keras")] == [], name


def test_only_the_backend_touches_private_apis():
    for name, path in modules(ROOT, "kerasps").items():
        imported = _imported(path)
        if name != "kerasps.backend._keras":
            assert [n for n in imported if n.startswith("keras.src")] == [], name
        if name != "kerasps.backend._tf":
            assert [n for n in imported if n.startswith("tensorflow.python")] == [], name


def test_the_checks_catch_a_hidden_circle_and_an_upward_import(tmp_path):
    # The shape before the layer folders: `_keras` imported the trainer inside a
    # function, the trainer imported `_keras` at module level.
    package = tmp_path / "kerasps"
    (package / "backend").mkdir(parents=True)
    (package / "keras").mkdir()
    for init in (package, package / "backend", package / "keras"):
        (init / "__init__.py").write_text("")
    (package / "backend" / "_keras.py").write_text(
        "def install():\n    from kerasps.keras import trainer\n")
    (package / "keras" / "trainer.py").write_text("from kerasps.backend import _keras\n")
    graph = import_graph(package, "kerasps")
    assert circles(graph) == [["kerasps.backend._keras", "kerasps.keras.trainer"]]
    assert upward_imports(graph) == [
        "kerasps.backend._keras imports kerasps.keras.trainer (line 2)"]


def test_the_flat_names_are_the_modules_themselves():
    import kerasps.cluster
    import kerasps.trainer.dispatch

    assert kerasps.cluster is sys.modules["kerasps.runtime.cluster"]
    assert kerasps.trainer.dispatch is sys.modules["kerasps.keras.trainer.dispatch"]
    assert kerasps.cluster.__spec__.name == "kerasps.runtime.cluster"
