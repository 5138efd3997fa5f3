"""SIGINT and SIGTERM for the trainer and the preprocessor: stop at a safe point, never mid-write.

`raising_signals()` makes both signals raise `Interrupted` (a KeyboardInterrupt) at once, so
SIGTERM unwinds like Ctrl-C and cleans up; inside `deferred_signals()` they are only recorded,
and the training loop acts on them at its next step boundary. Handlers are installed only in
the main thread (the only one Python delivers signals to); elsewhere both are no-ops.
"""
from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM. step: the training iteration it stopped after (None
    before training); saved: the checkpoint written on the way out, or None."""

    def __init__(self, signum: int, step: int | None = None, saved: str | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step, self.saved = int(signum), step, saved

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + self.signum


class Pending:
    """The first signal received while deferred: 0 when none."""

    def __init__(self):
        self.signum = 0

    def record(self, signum, frame=None) -> None:
        self.signum = self.signum or int(signum)


@contextlib.contextmanager
def _handlers(handler):
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _raise(signum, frame):
    raise Interrupted(signum)


def raising_signals():
    """Context manager: SIGINT and SIGTERM raise Interrupted where the program is."""
    return _handlers(_raise)


@contextlib.contextmanager
def deferred_signals():
    """Context manager yielding a Pending: SIGINT and SIGTERM are recorded there, not raised."""
    pending = Pending()
    with _handlers(pending.record):
        yield pending
