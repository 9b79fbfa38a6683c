"""Known-harmless warnings of TVM's C++ passes, kept off stderr while a training step compiles.

TVM 0.27 logs some warnings once per kernel, straight to file descriptor 2 (C++ ``LOG(WARNING)``,
with no level to set from Python), so a normal compile of a small BERT prints a dozen lines that
say nothing about the user's model.  ``quiet_known_warnings()`` passes everything else through,
line by line and in order: TVM's other warnings, Python's warnings, our progress lines.
``TVM_EVT_VERBOSE=1`` turns the filter off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading

VERBOSE_ENV = "TVM_EVT_VERBOSE"


@dataclasses.dataclass(frozen=True)
class Harmless:
    text: str  # a substring of the log line
    why: str


KNOWN_HARMLESS = (
    Harmless("Fast mode segfaults when there are out-of-bounds indices",
             "topi's take warns for every gather it lowers in its default mode; the gathers of a "
             "training graph (embeddings, their gradients, cross-entropy's target) read indices "
             "the frontend bounds by the tensor they index"),
    Harmless("Unknown pragma pragma_scope",
             "TVM's LLVM codegen ignores a scope pragma of its own CPU schedules"),
)


def harmless(line: bytes | str) -> bool:
    """Is `line` one of ``KNOWN_HARMLESS``?"""
    text = line.decode(errors="replace") if isinstance(line, bytes) else line
    return any(h.text in text for h in KNOWN_HARMLESS)


def _pump(src: int, dst: int) -> None:
    """Copy lines from `src` to `dst` until every writer of `src` has closed, dropping harmless ones."""
    with os.fdopen(src, "rb") as lines, contextlib.suppress(OSError):
        for line in lines:
            if not harmless(line):
                os.write(dst, line)
    os.close(dst)


@contextlib.contextmanager
def quiet_known_warnings():
    """Within the block, file descriptor 2 goes through a filter that drops ``KNOWN_HARMLESS``
    lines (a no-op with ``TVM_EVT_VERBOSE`` set)."""
    if os.environ.get(VERBOSE_ENV):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    pump = threading.Thread(target=_pump, args=(read, os.dup(saved)), daemon=True,
                            name="tvm_evt-stderr-filter")
    pump.start()
    os.dup2(write, 2)
    os.close(write)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer here closes; a child still holding it keeps the pump
        os.close(saved)
        pump.join(timeout=2.0)
