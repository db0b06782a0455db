"""Reading the project's own source files in tests."""

import ast
import gc
import pathlib


def parse(path: pathlib.Path) -> ast.Module:
    """`path`'s syntax tree, parsed with the garbage collector paused.

    Objects of earlier tests in the same process (the eager executors of failed steps)
    raise as they are collected; collected inside `ast.parse`, CPython 3.11 fails it with
    "SystemError: AST constructor recursion depth mismatch" (gh-106905). Under pytest-xdist
    a worker runs these tests after TensorFlow's, so the collector is paused instead.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text(), str(path))
    finally:
        if enabled:
            gc.enable()
