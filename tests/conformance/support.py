"""Helpers shared by the conformance tests."""

import pytest


def fail_without_traceback(reason):
    """Fails the test with `reason` only, without a traceback.

    For the expected failures of known defects, which fail on every run: to report a
    failure pytest parses sources with `ast`, which CPython 3.11.7 sometimes fails with
    `SystemError: AST constructor recursion depth mismatch` (cpython gh-106905) in these
    TensorFlow-heavy tests, an INTERNALERROR that ends the session.
    """
    message = f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else (
        str(reason))
    pytest.fail(message, pytrace=False)
