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
    """The tests marked `slow` (real-process clusters, failures, the tutorials); CI runs them."""
    session.install(".[test]")
    session.run("python", "-m", "pytest", "-m", "slow", *session.posargs)


@nox.session(python=PYTHON)
def stress(session):
    """Only the tests marked `stress` (not in the default run; CI runs them after it)."""
    session.install(".[test]")
    session.run("python", "-m", "pytest", "-m", "stress", *session.posargs)


@nox.session(python=PYTHON)
def benchmarks(session):
    """The figures in docs/figures.md: kerasps vs tf_keras throughput, embedding scaling, faults,
    the chaos soak, simulator speed and calibration."""
    session.install(".[bench]")
    session.run("python", "benchmarks/fit_throughput.py", *session.posargs)
    session.run("python", "benchmarks/embedding_scaling.py")
    session.run("python", "benchmarks/embedding_scaling.py", "--scale")
    session.run("python", "benchmarks/faults.py")
    session.run("python", "benchmarks/chaos.py")
    session.run("python", "benchmarks/stragglers.py")
    session.run("python", "benchmarks/input_throughput.py")
    session.run("python", "benchmarks/simulator_speed.py")
    session.run("python", "benchmarks/calibration.py")


@nox.session(python=PYTHON)
def demo(session):
    """The main job."""
    session.install(".")
    session.run("kerasps", "demo", *session.posargs)
