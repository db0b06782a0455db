"""The package's shape: one folder per layer, imports only downwards, no import circle.

The import graph is read from the source (every `import` statement, at module level
or inside a function alike), so an import hidden in a function counts as much as one
at the top of a module. `from kerasps.x import y` is an import of the module
`kerasps.x.y` where that is a module, else of `kerasps.x`.
"""

import ast
import collections
import importlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

import kerasps
from tests import sources

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
    ("kerasps.short", "the public modules' short names (kerasps/cluster.py ...): re-exports"),
)
_API = {"kerasps", "kerasps.strategy"}

# The public modules' short names, each a file of kerasps/ that re-exports the public
# names (`__all__`) of the module where they live. Programs and the docs use them; the
# package imports the real paths.
SHORT_NAMES = {
    "kerasps.callbacks": "kerasps.keras.callbacks",
    "kerasps.cli": "kerasps.ops.cli",
    "kerasps.cluster": "kerasps.runtime.cluster",
    "kerasps.consistency": "kerasps.policy.consistency",
    "kerasps.data_service": "kerasps.runtime.data_service",
    "kerasps.evaluator": "kerasps.keras.evaluator",
    "kerasps.input": "kerasps.runtime.input",
    "kerasps.launch": "kerasps.ops.launch",
    "kerasps.layers": "kerasps.keras.layers",
    "kerasps.membership": "kerasps.policy.membership",
    "kerasps.partitioners": "kerasps.policy.partitioners",
    "kerasps.placement": "kerasps.policy.placement",
    "kerasps.ray": "kerasps.runtime.ray_cluster",
    "kerasps.sparse": "kerasps.params.sparse",
    "kerasps.tables": "kerasps.policy.tables",
    "kerasps.trace": "kerasps.policy.trace",
}
# Those that are pure Python: importing them imports neither TensorFlow nor Keras.
PURE_SHORT_NAMES = ("kerasps.consistency", "kerasps.membership", "kerasps.partitioners",
                    "kerasps.placement", "kerasps.tables", "kerasps.trace")
# Flat names that were aliases of modules in the layer folders (an import hook of
# kerasps/__init__.py gave them until 2026-11-27): no module answers to them now.
OLD_ALIASES = ("kerasps._validation", "kerasps.failures", "kerasps.restarts", "kerasps._keras",
               "kerasps._tf", "kerasps.coordinator", "kerasps.variables", "kerasps.trainer",
               "kerasps.trainer.dispatch", "kerasps.console", "kerasps.demo",
               "kerasps.standby", "kerasps.manifests", "kerasps.layers.table",
               "kerasps.layers.dynamic_embedding", "kerasps.input.options")


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
        for node in ast.walk(sources.parse(path)):
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
    if name in SHORT_NAMES:
        return [layer for layer, _ in LAYERS].index("kerasps.short")
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


def test_modules_import_where_modules_live_not_their_short_names(graph):
    # `kerasps.cluster` is a short name for programs (kerasps/cluster.py); inside the
    # package an import names the module's folder, so that the graph shows the layers.
    short = [f"{name} imports {written} (line {line})"
             for name, targets in sorted(graph.items()) for target, written, line in sorted(targets)
             if target in SHORT_NAMES]
    assert short == []


def _imported(path: pathlib.Path) -> list:
    """The names of the modules a file imports (any depth), third-party ones included."""
    names = []
    for node in ast.walk(sources.parse(path)):
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


def test_only_the_backend_reads_an_optimizers_private_attributes():
    """Keras' optimizers' private attributes (`_trainable_variables`, `_use_weight_decay`)
    change with Keras as its private modules do: `kerasps.backend` reads them for the rest."""
    read = []
    for name, path in modules(ROOT, "kerasps").items():
        if name.startswith("kerasps.backend."):
            continue
        for node in ast.walk(sources.parse(path)):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and node.value.id.endswith("optimizer")):
                read.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
    assert read == []


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


# -- one name per module -------------------------------------------------------------------
def _spec(name):
    """`importlib.util.find_spec(name)`, or None where a parent of `name` is no package."""
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def test_the_files_at_the_top_are_the_api_and_the_short_names():
    top = {name for name, path in modules(ROOT, "kerasps").items() if path.parent == ROOT}
    assert top == _API | set(SHORT_NAMES)


def test_every_module_is_found_at_its_file_under_its_one_name():
    for name, path in modules(ROOT, "kerasps").items():
        spec = _spec(name)
        assert spec is not None and spec.name == name, name
        assert pathlib.Path(spec.origin).resolve() == path.resolve(), name
    assert [name for name in OLD_ALIASES if _spec(name) is not None] == []
    assert importlib.util.find_spec("kerasps.trainer") is None


def test_importing_kerasps_installs_no_finder_of_its_modules():
    """No import hook gives a module a second name. `import kerasps` adds a finder of
    `keras_rs` (which installs kerasps' keras-rs hooks with it) and, unless
    `KERASPS_TF_LOGS=1`, one of `tensorflow` (`kerasps.backend.tf_logs`, which drops
    TensorFlow's start-up lines); no finder it adds answers for a kerasps module or an old
    flat name."""
    names = sorted(modules(ROOT, "kerasps")) + list(OLD_ALIASES)
    code = f"""if True:
        import json, sys
        before = list(sys.meta_path)
        import kerasps
        added = [finder for finder in sys.meta_path if not any(finder is b for b in before)]
        answers = [(repr(finder), name) for finder in added for name in {names!r}
                   if finder.find_spec(name, None) is not None]
        print(json.dumps({{"added": sorted(finder.name for finder in added),
                          "answers": answers}}))
    """
    found = {}
    for tf_logs in ("1", "0"):
        env = {key: value for key, value in os.environ.items() if key != "KERASPS_TF_LOGS"}
        env.update(KERASPS_TF_LOGS=tf_logs, PYTHONPATH=str(ROOT.parent))
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        found[tf_logs] = json.loads(result.stdout.splitlines()[-1])
    assert found["1"] == {"added": ["keras_rs"], "answers": []}
    assert found["0"] == {"added": ["keras_rs", "tensorflow"], "answers": []}


def test_the_short_names_re_export_the_public_names_of_their_modules():
    for short, home in SHORT_NAMES.items():
        module, real = importlib.import_module(short), importlib.import_module(home)
        assert module is not real and module.__spec__.name == short
        assert pathlib.Path(module.__file__) == ROOT / f"{short.split('.')[1]}.py"
        assert f"`{home}`" in module.__doc__.splitlines()[0], short
        wanted = ["main"] if short == "kerasps.cli" else list(real.__all__)
        assert list(module.__all__) == wanted, (
            f"kerasps/{short.split('.')[1]}.py re-exports {home}'s `__all__`: {wanted}")
        for name in module.__all__:
            assert getattr(module, name) is getattr(real, name), f"{short}.{name}"
        attribute = short.split(".")[1]
        if attribute in kerasps.__all__:
            assert getattr(kerasps, attribute) is module


def test_the_short_names_import_as_programs_write_them():
    import kerasps.cluster
    import kerasps.layers
    from kerasps.cluster import in_process
    from kerasps.launch import request_workers
    from kerasps.layers import DynamicEmbedding

    assert kerasps.cluster.in_process is in_process
    assert kerasps.launch.request_workers is request_workers
    assert kerasps.layers.DynamicEmbedding is DynamicEmbedding
    assert kerasps.input.slowed is sys.modules["kerasps.runtime.input.options"].slowed
    for name in kerasps.__all__:
        assert getattr(kerasps, name) is not None, name


def test_the_pure_short_names_import_no_tensorflow():
    code = (f"import sys\nimport {', '.join(PURE_SHORT_NAMES)}\n"
            "heavy = sorted(m for m in ('tensorflow', 'keras') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT.parent)}, timeout=120)
    assert result.returncode == 0, result.stderr
