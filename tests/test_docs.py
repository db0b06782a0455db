"""The README and the documentation site's sources (docs/, built by `nox -s docs`).

The README's quick start is what a newcomer types and what CI runs (`.ci/run` runs its
test command verbatim): these tests fail when its two commands change shape, when the
docs' copy of them drifts, or when a relative link of the README points nowhere (GitHub
renders those links; `mkdocs build --strict` checks the docs' own links).
"""

import re
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
