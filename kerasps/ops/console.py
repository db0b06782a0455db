"""The console of `kerasps launch`: every task's output, prefixed with its task.

Children's output is read in chunks, not line by line, so that a Keras progress
bar, which redraws its line with a carriage return and writes no newline until
the epoch ends, is seen as it is drawn. Each task's stdout and stderr are
separate streams, each with its own current line.

On a terminal (`live`), the console's last line is a status line: the most
recently drawn progress bar (a line redrawn with a carriage return; else the
most recent unfinished line), redrawn in place with its prefix
(`[chief 0] 12/50 ━━━━...`) and cut to the terminal's width. A complete line
from any stream is written above it and the bar drawn again below, so that no
line is glued onto a partial bar; a bar's line is written when its newline
comes, as last drawn.

Elsewhere (a file, a CI log) only complete lines are written: a progress bar's
line is written once, as it was last drawn when its newline came.

Once the job is being stopped (`stop`: Ctrl-C), each unfinished line is written
once as a complete line, as last drawn, above the launcher's line that says so;
from then on only complete lines are written, live or not: no bar is drawn again
(nor written when its stream ends).

Colours and other escape sequences (Keras draws its bar in bold, green and grey
whatever its output is) reach a terminal only: a file or a CI log gets plain
text (`colors`).

TensorFlow's start-up lines (absl's "All log messages before
absl::InitializeLog()", "Could not find cuda drivers", "failed call to
cuInit", the oneDNN and CPU-instruction notices, ...), printed by every task
before its first useful line, are dropped unless `tf_logs`
(`kerasps.backend.tf_logs.is_start_up_noise`).

Pure Python: importing this module does not import TensorFlow.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import re
import sys
import threading

from kerasps.backend.tf_logs import is_start_up_noise

__all__ = ["Console", "PlainLines", "RayActorLines", "Stream", "is_start_up_noise", "plain",
           "plain_stdout"]

_CLEAR_LINE = "\x1b[K"  # erase from the cursor to the end of the line
_VISIBLE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|.", re.DOTALL)  # an escape sequence, or a character
# A terminal's escape sequence: CSI (colours, bold, cursor moves: `\x1b[1m`, `\x1b[32m`,
# `\x1b[K`), OSC (a window title, a link: `\x1b]...\x07`) or a two-character one.
_ESCAPE = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?|[@-Z\\-_])")


def plain(text: str) -> str:
    """`text` without its escape sequences (colours, bold): what a file gets."""
    return _ESCAPE.sub("", text)


class Stream:
    """One output stream of a task (its stdout or its stderr) and its unfinished line."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # the current line since its last carriage return
        self.drawn = ""  # the line as last drawn before a carriage return
        self.redrawn = False

    def feed(self, data: bytes, final: bool = False) -> list[str]:
        """Takes a chunk of output; returns the lines it completed."""
        text = self._decoder.decode(data, final).replace("\b", "")
        completed = []
        for piece in re.split(r"([\r\n])", text):
            if piece == "\r":
                if self.text:
                    self.drawn = self.text
                self.text, self.redrawn = "", True
            elif piece == "\n":
                line = self.text or (self.drawn if self.redrawn else "")
                # A redraw shorter than the one before ends in spaces that erased it.
                completed.append(line.rstrip(" ") if self.redrawn else line)
                self.text, self.drawn, self.redrawn = "", "", False
            else:
                self.text += piece
        if final and self.unfinished:
            completed.append(self.unfinished.rstrip(" ") if self.redrawn else self.unfinished)
            self.text, self.drawn, self.redrawn = "", "", False
        return completed

    def cut(self) -> str:
        """Ends the unfinished line here (what follows starts a new line); returns it as
        `feed` would have completed it ("" if there is none)."""
        line = self.unfinished.rstrip(" ") if self.redrawn else self.unfinished
        self.text, self.drawn, self.redrawn = "", "", False
        return line

    @property
    def unfinished(self) -> str:
        """What a terminal shows of the unfinished line ("" if there is none)."""
        return self.text or self.drawn


class RayActorLines:
    """Splits a Ray driver's output into its own and its task actors' lines.

    Ray forwards what an actor prints to the driver, each line prefixed with the actor's
    `repr` and process (`(worker 0 pid=4242) text`, `(ps 1 pid=77, ip=10.0.0.3) text`:
    `kerasps.runtime.ray_server.TaskServer`'s repr is its task's name). Under
    `kerasps launch --engine ray` the chief is the driver; its output goes through `split`,
    which gives each such line to its task, without Ray's prefix, and the rest to the chief.
    A line is held only while it may be the start of a prefix (from a `(` with no `)` or
    newline after it yet).
    """

    PREFIX = re.compile(rb"(?:\x1b\[[0-9;]*m)?\(((?:worker|ps) \d+) pid=\d+(?:, ip=[^)\n]*)?\)"
                        rb"(?:\x1b\[[0-9;]*m)? ?")
    _HOLD = 160  # the longest prefix held, bytes

    def __init__(self):
        self._held = b""

    def split(self, data: bytes, final: bool = False) -> list[tuple[str | None, bytes]]:
        """Takes a chunk of the driver's output; returns `(task, bytes)` pieces in order,
        `task` `None` for the driver's own (`final`: the stream ended, nothing held)."""
        buf, self._held, pieces = self._held + data, b"", []
        while buf:
            match = self.PREFIX.search(buf)
            if match is None:
                start = buf.rfind(b"(")
                tail = buf[start:] if start >= 0 else b""
                if (tail and not final and len(tail) < self._HOLD
                        and not any(c in tail for c in (b")", b"\n", b"\r"))):
                    pieces.append((None, buf[:start]))
                    self._held = tail
                else:
                    pieces.append((None, buf))
                break
            end = buf.find(b"\n", match.end())
            if end < 0 and not final:  # the actor's line is not complete yet
                pieces.append((None, buf[:match.start()]))
                self._held = buf[match.start():]
                break
            end = len(buf) if end < 0 else end + 1
            pieces.append((None, buf[:match.start()]))
            pieces.append((match.group(1).decode(), buf[match.end():end]))
            buf = buf[end:]
        return [(task, piece) for task, piece in pieces if piece]


class Console:
    """Writes the tasks' output and the launcher's messages to `out`, each prefixed.

    Args:
        out: a text stream.
        live: redraw unfinished lines (progress bars) in place; default: whether `out`
            is a terminal.
        tf_logs: keep TensorFlow's start-up lines.
        colors: keep the tasks' colours and other escape sequences; default: whether
            `out` is a terminal (elsewhere every line is plain text).
    """

    def __init__(self, out, live: bool | None = None, tf_logs: bool = False,
                 colors: bool | None = None):
        self._out = out
        try:
            terminal = out.isatty()
        except (AttributeError, ValueError):
            terminal = False
        self.live = terminal if live is None else live
        self.colors = terminal if colors is None else colors
        self.tf_logs = tf_logs
        # Reentrant: the launcher's signal handler writes from the main thread, which may be
        # writing already.
        self._lock = threading.RLock()
        self._status = None  # (stream, label, text) drawn on the terminal's last line
        self._unfinished = {}  # stream -> label, for the streams with an unfinished line
        self._stopped = False  # the job is being stopped: complete lines only

    def say(self, label: str, line: str):
        """Writes one complete line from `label` (the launcher's messages)."""
        self._update(None, label, [line])

    def feed(self, stream: Stream, label: str, data: bytes):
        """Writes what a chunk of `stream`'s output (task `label`) shows."""
        self._update(stream, label, stream.feed(data))

    def close(self, stream: Stream, label: str):
        """`stream` ended: its unfinished line is written as a complete one (after `stop`,
        a progress bar's is not)."""
        with self._lock:
            if self._stopped and stream.redrawn:
                stream.cut()
            self._update(stream, label, stream.feed(b"", final=True))

    def stop(self, label: str, line: str):
        """The job is being stopped: writes each unfinished line (a progress bar as last
        drawn) as a complete one, then `line` from `label`; from here on, complete lines
        only: no bar is drawn again."""
        with self._lock:
            # The bar (a line redrawn with a carriage return) last, as it was shown.
            pending = sorted(self._unfinished.items(), key=lambda item: item[0].redrawn)
            self._unfinished.clear()
            lines = self._lines([(each, stream.cut()) for stream, each in pending]
                                + [(label, line)])
            self._write(self._redraw(lines) if self.live else "".join(lines))
            self._stopped = True

    def _lines(self, labelled) -> list[str]:
        """The lines written for `(label, line)` pairs: prefixed, plain text unless
        `colors`, TensorFlow's start-up lines dropped unless `tf_logs`."""
        written = []
        for label, line in labelled:
            if not self.colors:
                line = plain(line)
            if self.tf_logs or not is_start_up_noise(line):
                written.append(f"[{label}] {line}\n")
        return written

    def _update(self, stream, label, completed):
        lines = self._lines([(label, line) for line in completed])
        with self._lock:
            if stream is not None and not self._stopped:
                self._unfinished.pop(stream, None)
                if stream.unfinished:
                    self._unfinished[stream] = label  # the most recently drawn last
            if self.live and not self._stopped:
                self._write(self._redraw(lines))
            else:
                self._write("".join(lines))

    def _write(self, text: str):
        if text:
            self._out.write(text)
            self._out.flush()

    def _redraw(self, lines) -> str:
        # The status line shows the most recently drawn progress bar (a line redrawn with
        # a carriage return), else the most recent unfinished line.
        pending = sorted(self._unfinished.items(), key=lambda item: item[0].redrawn)
        new = (pending[-1][0], pending[-1][1], pending[-1][0].unfinished) if pending else None
        if new is not None and not self.colors:
            new = (*new[:2], plain(new[2]))
        old, out = self._status, []
        if lines:
            if old is not None:
                out.append("\r" + _CLEAR_LINE)  # drawn again below the lines
            out.extend(lines)
            old = None
        if new is not None and new != old:
            out.append(f"\r{self._fit(f'[{new[1]}] {new[2]}')}{_CLEAR_LINE}")
        elif new is None and old is not None:
            out.append("\r" + _CLEAR_LINE)
        self._status = new
        return "".join(out)

    def _fit(self, text: str) -> str:
        """`text` cut to the terminal's width: a wrapped line cannot be redrawn in place
        (escape sequences, Keras' bold step count, take no room)."""
        try:
            width = os.get_terminal_size(self._out.fileno()).columns
        except (AttributeError, OSError, ValueError):
            return text
        if width <= 0:  # not known
            return text
        pieces, room = [], width - 1
        for match in _VISIBLE.finditer(text):
            if not match.group().startswith("\x1b"):
                if room == 0:
                    return "".join(pieces) + "\x1b[0m"
                room -= 1
            pieces.append(match.group())
        return text


class PlainLines(io.TextIOBase):
    """A text stream that passes to `out` complete lines only, as `Console` writes them
    to a file: a line redrawn with carriage returns and backspaces (a Keras progress bar)
    once, as last drawn, when its newline comes, and no escape sequences (`plain`).
    `finish()` writes the unfinished line, if any."""

    def __init__(self, out):
        super().__init__()
        self._out = out
        self._stream = Stream()
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._write(self._stream.feed(text.encode("utf-8")))
        return len(text)

    def finish(self):
        with self._lock:
            self._write(self._stream.feed(b"", final=True))

    def _write(self, lines):
        if lines:
            self._out.write("".join(plain(line) + "\n" for line in lines))
            self._out.flush()

    def flush(self):
        self._out.flush()

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._out.fileno()

    @property
    def encoding(self):
        return getattr(self._out, "encoding", "utf-8")


@contextlib.contextmanager
def plain_stdout():
    """`sys.stdout` a `PlainLines` while the block runs, unless it is a terminal: a
    program's output to a file or a pipe (`kerasps demo > log`) has the lines a terminal
    shows, without Keras' colours, carriage returns and backspaces (Keras redraws its
    progress bar whatever its output is)."""
    out = sys.stdout
    try:
        terminal = out is None or out.isatty()
    except (AttributeError, ValueError):
        terminal = False
    if terminal:
        yield
        return
    sys.stdout = lines = PlainLines(out)
    try:
        yield
    finally:
        try:
            lines.finish()
        finally:
            sys.stdout = out
