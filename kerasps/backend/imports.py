"""Imports on first use: a module's lazy public names, and code run around a package's
first import (a `sys.meta_path` finder).

`kerasps`, `kerasps.layers` and `kerasps.keras.layers` read their public names from
their modules on first use (`lazy_attributes`). `tf_logs` drops TensorFlow's start-up
lines while `tensorflow` is imported; `import kerasps` installs its keras-rs hooks once
`keras_rs` is imported (`kerasps.keras.hooks.install_keras_rs`), so that a `.keras`
file holding a kerasps dynamic table loads in a program that imported kerasps and made
no strategy.

Pure Python: importing this module imports no package it watches.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager


def lazy_attributes(module: str, table: dict[str, str | None]):
    """The `__getattr__` of `module` whose public names in `table` are imported on first
    use and kept in the module: each name maps to the module it is read from, or to
    `None` for a submodule of `module` of that name."""

    def __getattr__(name):
        if name not in table:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home = table[name]
        value = (importlib.import_module(f"{module}.{name}") if home is None
                 else getattr(importlib.import_module(home), name))
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__


class _Loader(importlib.abc.Loader):
    """Runs a package's own loader inside `around()`."""

    def __init__(self, loader, around: Callable[[], AbstractContextManager]):
        self._loader = loader
        self._around = around

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # From here on the package has its own loader, as if imported without kerasps.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        with self._around():
            self._loader.exec_module(module)


class _FirstImport(importlib.abc.MetaPathFinder):
    """Finds package `name` as the finders after it do, its loader run inside `around()`."""

    def __init__(self, name: str, around: Callable[[], AbstractContextManager]):
        self.name = name
        self.around = around

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if isinstance(finder, _FirstImport) or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self.around)
        return spec


def around_first_import(name: str, around: Callable[[], AbstractContextManager]) -> bool:
    """Runs the first `import name` (a top-level package) inside `around()`, a context
    manager factory. Returns `False`, doing nothing, where `name` is imported already or
    watched so."""
    if name in sys.modules or watched(name):
        return False
    sys.meta_path.insert(0, _FirstImport(name, around))
    return True


def watched(name: str) -> bool:
    """Whether the first `import name` will run inside a context (`around_first_import`)."""
    return any(isinstance(finder, _FirstImport) and finder.name == name
               for finder in sys.meta_path)


def after_import(name: str, function: Callable[[], object]):
    """Calls `function()` once package `name` is imported: now if it is, else right
    after its first import."""
    if name in sys.modules:
        function()
        return

    @contextlib.contextmanager
    def then_call():
        yield
        function()

    around_first_import(name, then_call)
