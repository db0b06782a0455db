"""MkDocs hooks for kerasps' documentation (`mkdocs build --strict`).

* The tutorial notebooks (`tutorials/*.ipynb`, outside `docs/`) are added to the site's
  files under `tutorials/`, before mkdocs-jupyter looks at the files: it makes each a page,
  with the outputs and plots the notebook is stored with (`execute: false` in mkdocs.yml),
  which the nav lists and `docs/tutorials.md` links to (the build checks those links).
* Every backticked API name in a page (`kerasps.cluster.from_tf_config`,
  `simulator.calibrate.predict_goodput`) must name something in the code, and every
  backticked repository path (`kerasps/params/sparse.py`, `tutorials/03_....ipynb`) must exist:
  a stale name is a warning, which `--strict` turns into a failed build. Names are
  looked up statically (griffe), without importing TensorFlow.
"""

import ast
import logging
import re
from functools import cache
from pathlib import Path

import griffe
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).parent
PACKAGES = ("kerasps", "simulator")
log = logging.getLogger("mkdocs.hooks.kerasps")

API_NAME = re.compile(r"`((?:kerasps|simulator)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
REPO_PATH = re.compile(r"`((?:kerasps|simulator|benchmarks|tutorials|tests)/[A-Za-z0-9_.*/-]*)")


@event_priority(100)  # before mkdocs-jupyter's `on_files` (default priority 0)
def on_files(files, config):
    """Adds `tutorials/*.ipynb` to the site's files, under `tutorials/`, for mkdocs-jupyter
    to render as pages."""
    for notebook in sorted((ROOT / "tutorials").glob("*.ipynb")):
        files.append(File(f"tutorials/{notebook.name}", src_dir=str(ROOT),
                          dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    """Warns about backticked API names and repository paths that do not exist, in the
    Markdown pages (a notebook's page gets its notebook's JSON here, which is not checked)."""
    if page.file.src_uri.endswith(".ipynb"):
        return markdown
    for name in sorted(set(API_NAME.findall(markdown))):
        if not _resolves(name):
            log.warning("Doc file '%s' names `%s`, which is not in the code",
                        page.file.src_uri, name)
    for path in sorted(set(REPO_PATH.findall(markdown))):
        if not any(ROOT.glob(path.rstrip("/"))):  # a path, or a pattern (`records/x_*.json`)
            log.warning("Doc file '%s' names `%s`, which is not in the repository",
                        page.file.src_uri, path)
    return markdown


@cache
def _module(dotted):
    """The griffe module `dotted` if it is a module of the repository, else None."""
    base = ROOT.joinpath(*dotted.split("."))
    if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
        return None
    return griffe.load(dotted, search_paths=[str(ROOT)], resolve_aliases=False)


@cache
def _lazy(package):
    """A package's or module's `_LAZY` table (name -> module, or None for a submodule of
    a package), if any."""
    base = ROOT.joinpath(*package.split("."))
    source = base / "__init__.py" if (base / "__init__.py").exists() else base.with_suffix(".py")
    if not source.exists():
        return {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                getattr(target, "id", None) == "_LAZY" for target in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _resolves(name):
    parts = name.split(".")
    # The longest prefix that is a module; the rest are members of it.
    for cut in range(len(parts), 0, -1):
        module = _module(".".join(parts[:cut]))
        if module is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        lazy = _lazy(".".join(parts[:cut]))
        if rest[0] in lazy and lazy[rest[0]] is not None:
            return _resolves(".".join([lazy[rest[0]], *rest]))
        if rest[0] in ("__all__", "__version__"):
            return len(rest) == 1
        try:
            module[".".join(rest)]
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return False
        return True
    return False
