"""The README and the documentation site's sources (docs/, built by `mkdocs build --strict`).

The README's quick start is what a newcomer types and what CI runs (`.ci/run` runs its
test command verbatim): these tests fail when its two commands change shape, when the
docs' copy of them drifts, or when a relative link of the README points nowhere (GitHub
renders those links; `mkdocs build --strict` checks the docs' own links).
"""

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICK_START = [
    "pip install . && kerasps demo",
    'pip install ".[test]" && python -m pytest',
]


def quick_start_commands(markdown):
    """The commands (comments stripped) of the `bash` block under `## Quick start`."""
    section = re.search(r"(?ms)^## Quick start\n(.*?)(?=^## |\Z)", markdown)
    assert section, "no '## Quick start' section"
    blocks = re.findall(r"(?ms)^```bash\n(.*?)^```", section.group(1))
    assert len(blocks) == 1, f"expected one bash block in the quick start, found {len(blocks)}"
    return [line.split("  #")[0].strip() for line in blocks[0].splitlines() if line.strip()]


def test_readme_quick_start_is_exactly_two_commands():
    assert quick_start_commands(README.read_text()) == QUICK_START


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert QUICK_START[1] in [line.strip() for line in ci]


def test_docs_index_quick_start_matches_the_readme():
    index = (ROOT / "docs" / "index.md").read_text()
    assert quick_start_commands(index) == quick_start_commands(README.read_text())


@pytest.mark.parametrize("path", ["README.md", "docs/index.md"])
def test_quick_start_names_the_demo_flags_the_cli_has(path):
    flags = set(re.findall(r"`(--[a-z-]+)`", re.search(
        r"(?ms)^## Quick start\n(.*?)(?=^## |\Z)", (ROOT / path).read_text()).group(1)))
    cli = (ROOT / "kerasps" / "ops" / "cli.py").read_text()
    assert flags, "the quick start lists the demo's flags"
    assert not {flag for flag in flags if f'"{flag}"' not in cli}


def test_readme_relative_links_exist():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert relative, "the README links to the docs"
    assert not [link for link in relative if not (ROOT / link).exists()]


def test_readme_links_every_docs_page_of_the_user_guide():
    readme = README.read_text()
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")
                   if "api" not in p.parts)
    assert not [page for page in pages if f"]({page})" not in readme]


# -- The documentation's code blocks (pytest-markdown-docs runs the `python` ones) ----------

DOC_PAGES = sorted([README, *(ROOT / "docs").rglob("*.md")])
GUIDES = sorted((ROOT / "docs" / "guide").glob("*.md"))
FENCE = re.compile(r"(?m)^```(.*)$")


def fences(markdown):
    """The info strings of a page's fenced blocks (`python`, `{.python notest}`, ...)."""
    return FENCE.findall(markdown)[0::2]


def prose_lines(markdown):
    """A page's lines outside fenced blocks and tables, link targets left out."""
    inside = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside and not line.startswith("|"):
            yield re.sub(r"\]\([^)]*\)", "]()", line)


@pytest.mark.parametrize("guide", GUIDES, ids=lambda path: path.name)
def test_every_guide_page_opens_with_a_python_program(guide):
    infos = fences(guide.read_text())
    assert infos and infos[0] == "python", f"first block: {infos[:1]}"


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_python_blocks_run_or_are_skipped_in_the_form_mkdocs_renders(page):
    # ```python runs; a skipped block is ```{.python notest}: MkDocs (superfences) renders
    # `python notest` as plain text, and `py`/`python3` would be run but read as other
    # languages by readers and tools.
    infos = [info.strip() for info in fences(page.read_text())]
    python = [info for info in infos if "python" in info or info in ("py", "python3")]
    assert not [info for info in python if info not in ("python", "{.python notest}")]


@pytest.mark.parametrize("page", [README, *GUIDES, ROOT / "docs" / "index.md",
                                  ROOT / "docs" / "tutorials.md"],
                         ids=lambda path: path.relative_to(ROOT).as_posix())
def test_prose_lines_are_under_100_characters(page):
    assert not [line for line in prose_lines(page.read_text()) if len(line) >= 100]


def test_the_default_run_collects_the_documentation_blocks():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pytest_options = config["tool"]["pytest"]["ini_options"]
    assert {"docs", "README.md"} <= set(pytest_options["testpaths"])
    assert "--markdown-docs" in pytest_options["addopts"].split()
    assert [r for r in config["project"]["optional-dependencies"]["test"]
            if r.startswith("pytest-markdown-docs>=")]


def test_the_docs_extra_renders_the_tutorials():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert [r for r in config["project"]["optional-dependencies"]["docs"]
            if r.startswith("mkdocs-jupyter>=")]


def readme_section(title):
    section = re.search(rf"(?ms)^## {title}\n(.*?)(?=^## |\Z)", README.read_text())
    assert section, f"no '## {title}' section"
    return section.group(1)


def test_readme_figures_are_one_short_line_per_result_without_dates():
    figures = readme_section("Figures")
    rows = [line for line in figures.splitlines() if line.startswith("| ")][1:]
    assert rows, "the Figures table"
    assert not re.search(r"\b20\d\d-\d\d-\d\d", figures), "dates belong in docs/figures.md"
    assert not [row for row in rows if row.count("|") != 4 or len(row) > 200]
    assert "](docs/figures.md)" in figures


def test_readme_says_how_to_build_the_docs_without_nox():
    documentation = readme_section("Documentation")
    assert 'pip install ".[docs]" && NO_MKDOCS_2_WARNING=1 mkdocs build --strict' in documentation
    if "nox -s docs" in documentation:
        assert "pip install nox" in documentation or '".[dev]"' in documentation


def test_readme_names_the_library_that_runs_the_examples():
    assert "pytest-markdown-docs" in readme_section("Documentation")


def test_every_tutorial_is_a_page_of_the_site():
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    tutorials = (ROOT / "docs" / "tutorials.md").read_text()
    notebooks = sorted(p.name for p in (ROOT / "tutorials").glob("*.ipynb"))
    assert notebooks
    assert not [n for n in notebooks if f": tutorials/{n}\n" not in mkdocs]
    assert not [n for n in notebooks if f"](tutorials/{n})" not in tutorials]
    assert re.search(r"(?m)^  - mkdocs-jupyter:\n      execute: false$", mkdocs)


# -- Each guide's first program, as a user runs it --------------------------------------------

def python_blocks(markdown):
    """The code of a page's ```python blocks, in order."""
    return re.findall(r"(?ms)^```python\n(.*?)^```", markdown)


IMPORTED = re.compile(r"(?m)^(?:import|from) (\w+)")
BEFORE_KERASPS = {"keras", "tensorflow", "keras_rs", "tf_keras"}  # each imports TensorFlow


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_program_imports_kerasps_before_what_imports_tensorflow(page):
    """`import kerasps` keeps TensorFlow's start-up lines off the console only when it
    comes before TensorFlow's import (tests below run the guides' programs)."""
    late = []
    for block in python_blocks(page.read_text()):
        modules = IMPORTED.findall(block)
        if "kerasps" in modules:
            first = modules.index("kerasps")
            late += [m for m in modules[:first] if m in BEFORE_KERASPS]
    assert not late, f"imported before kerasps: {late}"


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_program_makes_its_cluster_with_resolve(page):
    """One way everywhere: `kerasps.cluster.resolve(...)` starts an in-process cluster
    alone and reads TF_CONFIG under `kerasps launch` (where `in_process` raises)."""
    other = [call for block in python_blocks(page.read_text())
             for call in re.findall(r"kerasps\.cluster\.(in_process|from_tf_config)\(", block)]
    assert not other


@pytest.mark.slow
@pytest.mark.parametrize("guide", GUIDES, ids=lambda path: path.name)
def test_a_guides_first_program_runs_and_prints_no_tensorflow_start_up_line(
        guide, tmp_path, monkeypatch):
    """The guide's first program, as a user runs it (`python program.py`, a fresh
    interpreter, TensorFlow's logging left to kerasps): it ends with status 0, and its
    stderr holds none of TensorFlow's start-up lines (oneDNN, "Could not find cuda
    drivers", ...: kerasps.backend.tf_logs)."""
    from kerasps.backend import tf_logs
    from tests.launched import run_with_deadline

    for name in ("TF_CPP_MIN_LOG_LEVEL", tf_logs.ENV, "TF_CONFIG", "KERASPS_TASK"):
        monkeypatch.delenv(name, raising=False)  # the test session's settings, not a user's
    program = python_blocks(guide.read_text())[0]
    done = run_with_deadline(program, deadline=300, cwd=tmp_path,
                             what=f"{guide.name}'s first program")
    assert done.returncode == 0, done.stderr[-3000:]
    noise = [line for line in done.stderr.splitlines() if tf_logs.is_start_up_noise(line)]
    assert not noise, "\n".join(noise)


# -- The guides' index: every page reachable, every strategy argument listed -----------------

def test_every_guide_page_is_linked_from_the_index_the_readme_and_the_nav():
    index = (ROOT / "docs" / "index.md").read_text()
    guide_list = readme_section("Documentation")
    nav = re.search(r"(?ms)^nav:\n(.*?)(?=^\S|\Z)", (ROOT / "mkdocs.yml").read_text()).group(1)
    names = [guide.name for guide in GUIDES]
    assert names
    assert not [n for n in names if f"](guide/{n})" not in index], "docs/index.md"
    assert not [n for n in names if f"](docs/guide/{n})" not in guide_list], "README.md"
    assert not [n for n in names if not re.search(rf"(?m): guide/{re.escape(n)}$", nav)], (
        "mkdocs.yml's nav")


def table_rows(markdown, heading):
    """The first cells (backticks and `=...` dropped) and the rows of the first table
    under `heading`."""
    section = re.search(rf"(?ms)^{re.escape(heading)}\n(.*?)(?=^#|\Z)", markdown)
    assert section, f"no {heading!r} section"
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")][2:]
    assert rows, f"no table under {heading!r}"
    cells = [row.split("|")[1].strip() for row in rows]
    return {re.fullmatch(r"`(\w+)(=\w+)?`", cell).group(1): row
            for cell, row in zip(cells, rows)}


def strategy_arguments():
    import inspect

    keras = pytest.importorskip("keras")  # noqa: F841 - kerasps' strategy needs it
    import kerasps

    signature = inspect.signature(kerasps.ParameterServerStrategy.__init__)
    return [name for name in signature.parameters if name != "self"]


def test_the_strategy_arguments_table_lists_every_argument_of_the_strategy():
    """strategy-and-placement.md's `## Strategy arguments` table is the index of the
    strategy's options: one row per argument, no row for one it does not take."""
    rows = table_rows((ROOT / "docs" / "guide" / "strategy-and-placement.md").read_text(),
                      "## Strategy arguments")
    assert sorted(rows) == sorted(strategy_arguments())


def test_the_sync_guides_options_table_names_every_mode_and_where_backups_apply():
    from kerasps.policy.consistency import Mode

    rows = table_rows((ROOT / "docs" / "guide" / "sync.md").read_text(), "## Options")
    assert set(rows) <= set(strategy_arguments()), "a row for an argument the strategy lacks"
    assert not [m.value for m in Mode if f'`"{m.value}"`' not in rows["mode"]]
    mode_column = rows["backup_workers"].split("|")[2]
    assert not [m.value for m in Mode if m is not Mode.ASYNC and m.value not in mode_column]


# Another project's issue, named with its project ("TensorFlow's ... its issue 182").
_THEIR_ISSUE = re.compile(r"(its|CPython|TensorFlow's|Keras'|Ray's) issues? \d+")


def test_user_facing_text_speaks_of_the_product_not_of_its_tracker():
    # A benchmark's `--help` said "(issue 33)": the tracker is not the user's.
    sources = [README, *(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").glob("*.py"),
               ROOT / "benchmarks" / "README.md", *(ROOT / "tutorials").glob("*.ipynb"),
               *(ROOT / "kerasps").rglob("*.py"), *(ROOT / "simulator").rglob("*.py")]
    found = []
    for path in sources:
        text = path.read_text()
        for match in re.finditer(r"\bissues? \d+", text):
            said = text[max(0, match.start() - 16):match.end()]
            if not _THEIR_ISSUE.search(said):
                found.append(f"{path.relative_to(ROOT)}: {said!r}")
    assert not found, found
