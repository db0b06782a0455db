"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s notebooks`, `nox -s tutorials`,
`nox -s slow`, `nox -s stress`, `nox -s benchmarks`, `nox -s demo`, `nox -s docs`. Each runs
in a fresh virtual environment."""

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"
PYTHON = "3.11"


@nox.session(python=PYTHON)
def tests(session):
    """The README's test command: the default run (neither `slow` nor `stress`)."""
    session.install(".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python=PYTHON)
def lint(session):
    """ruff over the packages, tests, benchmarks and notebooks."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "kerasps", "simulator", "tests", "benchmarks", "tutorials",
                "noxfile.py")


@nox.session(python=PYTHON)
def docs(session):
    """The documentation site (`site/`), `mkdocs build --strict`: a broken link, a stale API
    name or a docstring mkdocstrings rejects fails. Installs the `docs` extra's packages
    only: the API reference is read from the source (griffe), without TensorFlow."""
    extras = nox.project.load_toml("pyproject.toml")["project"]["optional-dependencies"]
    session.install(*extras["docs"])
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session(python=PYTHON)
def notebooks(session):
    """Executes the tutorials only."""
    session.install(".[test]")
    session.run("python", "-m", "pytest", "-m", "notebook", *session.posargs)


@nox.session(python=PYTHON)
def tutorials(session):
    """Executes the tutorials and stores them executed (outputs and plots committed)."""
    session.install(".[test]")
    session.run("python", "-m", "tests.notebooks", *session.posargs)


@nox.session(python=PYTHON)
def slow(session):
    """The tests marked `slow` (real-process clusters, failures, the tutorials), as CI runs
    them: a test file per process on two processes, the network bench's link cuts alone."""
    session.install(".[test]")
    session.run("python", "-m", "pytest", "-m", "slow", "--ignore", "tests/test_netbench.py",
                *session.posargs)
    session.run("python", "-m", "pytest", "-m", "slow", "-n", "0", "tests/test_netbench.py",
                *session.posargs)


@nox.session(python=PYTHON)
def stress(session):
    """Only the tests marked `stress` (not in the default run; CI runs them after it), a
    test per process on two processes: they load the machine on purpose."""
    session.install(".[test]")
    session.run("python", "-m", "pytest", "-m", "stress", "--dist", "load", *session.posargs)


BENCHMARKS = ("fit_throughput", "fit_overhead", "crossings", "embedding_scaling", "faults",
              "chaos", "soak", "stragglers", "hybrid", "input_throughput", "dynamic_embedding",
              "keras_rs_tables", "simulator_speed", "calibration")


@nox.session(python=PYTHON)
def benchmarks(session):
    """The figures in docs/figures.md, each benchmark in turn (hours); `nox -s benchmarks --
    --quick` runs every benchmark's smoke mode instead, as CI's `slow` tests do.
    `benchmarks/network.py` needs root and network namespaces: run it by hand."""
    session.install(".[bench]")
    for name in BENCHMARKS:
        session.run("python", f"benchmarks/{name}.py", *session.posargs)
    if "--quick" not in session.posargs:
        session.run("python", "benchmarks/embedding_scaling.py", "--scale")


@nox.session(python=PYTHON)
def demo(session):
    """The main job."""
    session.install(".")
    session.run("kerasps", "demo", *session.posargs)
