"""Tracebacks that leave kerasps' `fit`, `evaluate` and `predict` without its frames.

Keras filters its own frames (and TensorFlow's) out of the exceptions that leave its
`fit` (`keras.config.is_traceback_filtering_enabled()`); kerasps' trainer, which
replaces Keras' `fit` for a model built under a kerasps strategy, is filtered the same
way: an exception (Ctrl-C's `KeyboardInterrupt` included) that leaves it shows the
user's line, the `fit` call, and the user's own code it ran (a callback), without the
frames of kerasps, Keras and TensorFlow, nor those of the standard library that they
called (the lock Ctrl-C interrupted). `keras.config.disable_traceback_filtering()`
keeps every frame.
"""

from __future__ import annotations

import functools
import os
import sysconfig
import types

import keras

__all__ = ["filtered", "without_internal_frames"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # kerasps/
_INTERNAL = (_PACKAGE + os.sep, os.path.dirname(os.path.abspath(keras.__file__)) + os.sep)
_TENSORFLOW = os.path.join("tensorflow", "python")  # as Keras recognises TensorFlow's frames
_PATHS = sysconfig.get_paths()
_STDLIB = tuple({os.path.join(_PATHS[k], "") for k in ("stdlib", "platstdlib")})
_SITE = tuple({os.path.join(_PATHS[k], "") for k in ("purelib", "platlib")})


def _internal(filename: str) -> bool:
    """Whether `filename` is kerasps', Keras' or TensorFlow's Python code."""
    return filename.startswith(_INTERNAL) or _TENSORFLOW in filename


def _stdlib(filename: str) -> bool:
    """Whether `filename` is the standard library's (not a package installed beside it)."""
    return filename.startswith("<frozen ") or (filename.startswith(_STDLIB)
                                               and not filename.startswith(_SITE))


def without_internal_frames(traceback: types.TracebackType | None):
    """`traceback` without kerasps', Keras' and TensorFlow's frames, nor the standard
    library's frames that they called; None if no frame is left."""
    kept, internal_caller = [], True  # the traceback starts in kerasps
    while traceback is not None:
        filename = traceback.tb_frame.f_code.co_filename
        if _internal(filename):
            internal_caller = True
        elif not (_stdlib(filename) and internal_caller):
            kept.append(traceback)
            internal_caller = False
        traceback = traceback.tb_next
    filtered_traceback = None
    for each in reversed(kept):
        filtered_traceback = types.TracebackType(filtered_traceback, each.tb_frame,
                                                 each.tb_lasti, each.tb_lineno)
    return filtered_traceback


def _filter(error: BaseException, seen: set):
    """Filters the traceback of `error` and of the exceptions chained to it."""
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = without_internal_frames(error.__traceback__)
        _filter(error.__cause__, seen)
        error = error.__context__


def filtered(function):
    """Decorates a `fit`, `evaluate` or `predict` of kerasps: an exception that leaves it
    has no frame of kerasps, Keras or TensorFlow (nor in the exceptions chained to it)
    while Keras' traceback filtering is enabled; for a `KeyboardInterrupt`, what kerasps
    was handling when Ctrl-C came is not shown either. Ctrl-C leaves as a
    `KeyboardInterrupt` also where CPython turned it into a lock's `RuntimeError`."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (Exception, KeyboardInterrupt) as error:
            interrupt = _interrupt_of(error)
            if interrupt is None:
                _filter_if_enabled(error)
                raise  # as it is: a `raise error` would add this frame to its traceback
        _filter_if_enabled(interrupt)
        raise interrupt

    return call


def _filter_if_enabled(error: BaseException):
    if keras.config.is_traceback_filtering_enabled():
        _filter(error, set())
        if isinstance(error, KeyboardInterrupt):
            error.__suppress_context__ = True


# What CPython raises where a `with lock:` block ends without the lock: a Ctrl-C that
# interrupted `Condition.wait` getting its lock back (held by another thread) left it so.
_UNHELD_LOCK = ("release unlocked lock", "cannot release un-acquired lock")


def _interrupt_of(error: BaseException) -> KeyboardInterrupt | None:
    """The `KeyboardInterrupt` that `error`, a lock's release refused, was raised over,
    if that is what it is: Ctrl-C, which leaves as itself."""
    context = error.__context__
    if (isinstance(error, RuntimeError) and str(error) in _UNHELD_LOCK
            and isinstance(context, KeyboardInterrupt)):
        return context
    return None
