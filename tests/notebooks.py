"""Executes tutorial notebooks the way a reader would, failing on any error.

`python -m tests.notebooks [NAME ...]` executes the tutorials (all, or those named) and
stores them executed, so that a reader on GitHub sees their outputs and plots
(`nox -s tutorials`); the tests execute fresh copies and never write.
"""

import os
import pathlib
import sys

import nbformat
from nbclient import NotebookClient

TUTORIALS = pathlib.Path(__file__).resolve().parent.parent / "tutorials"


def run_notebook(name: str, timeout: int = 600, plots: bool = False) -> nbformat.NotebookNode:
    """Runs every cell of `tutorials/<name>` in a fresh kernel; returns the executed notebook.

    Plots are drawn headless (`Agg`) unless `plots`, which keeps them as cell outputs
    (Jupyter's inline backend). Raises `nbclient.exceptions.CellExecutionError` naming
    the failing cell.
    """
    path = TUTORIALS / name
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    if plots:  # the kernel inherits the environment
        os.environ.pop("MPLBACKEND", None)
    else:
        os.environ.setdefault("MPLBACKEND", "Agg")
    client.execute()
    return nb


def store_executed(names=None, timeout: int = 900):
    """Executes `tutorials/<name>` for each name (every tutorial by default) and writes
    it back with its outputs."""
    from kerasps.ops.console import is_start_up_noise

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ logs, as in tests
    for name in names or sorted(p.name for p in TUTORIALS.glob("*.ipynb")):
        print(f"executing {name}", flush=True)
        nb = run_notebook(name, timeout=timeout, plots=True)
        for cell in nb.cells:  # TensorFlow's start-up lines are no reading matter
            if cell.cell_type == "code":
                for output in cell.outputs:
                    if output.output_type == "stream" and output.name == "stderr":
                        output.text = "".join(line for line in output.text.splitlines(True)
                                              if not is_start_up_noise(line))
                cell.outputs = [o for o in cell.outputs
                                if not (o.output_type == "stream" and not o.text)]
        nbformat.write(nb, TUTORIALS / name)


if __name__ == "__main__":
    store_executed(sys.argv[1:])
