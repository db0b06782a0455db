"""The documentation's code blocks as tests (pytest-markdown-docs, `--markdown-docs`).

Every ```python block of `docs/` and README.md runs as one test item (pyproject's
`testpaths` and `addopts`); a block that starts an in-process cluster costs a few seconds
(its servers live until the process exits). This file is not part of the site
(mkdocs.yml's `exclude_docs`).
"""

import contextlib
import os
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # as in tests/conftest.py

import pytest  # noqa: E402

MARKER = "markdown-docs"  # the plugin marks every item it collects
TIMEOUT_S = 300  # a block takes seconds; pytest-timeout ends a hung one with its stacks
# Pages whose blocks start processes of their own (a local Ray and its actors: over a
# minute on 2 cores) are `slow`, as the tests of real-process clusters are.
SLOW_PAGES = ("ray.md",)


def _is_block(item):
    return item.get_closest_marker(MARKER) is not None


def pytest_collection_modifyitems(items):
    """A hung block ends the run after `TIMEOUT_S`, as a hung test does (tests/conftest.py
    gives every item a limit, when a run loads it: `pytest docs` alone does not); the
    blocks of `SLOW_PAGES` are `slow`."""
    for item in items:
        if _is_block(item) and item.path.name in SLOW_PAGES:
            item.add_marker(pytest.mark.slow)
        if _is_block(item) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUT_S))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Runs a block with pytest's output capture kept on.

    pytest-markdown-docs (0.9) turns capturing off around each block, so the blocks'
    prints, progress bars and TensorFlow's C++ log lines would fill the terminal between
    the dots of a passing run (its issue 54). With capturing on, they are shown only
    for a block that fails, as for any test. A global hook (not one filtered by path),
    so that it also covers README.md's blocks.
    """
    if not _is_block(item):
        return (yield)
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        return (yield)
    with mock.patch.object(capture, "global_and_fixture_disabled", contextlib.nullcontext):
        return (yield)
