"""Signals that stop a command (SIGTERM, SIGINT) and the writes they must not cut in half.

The CLI turns both signals into :class:`Stopped` (a ``KeyboardInterrupt``) raised wherever the main thread is,
so a run unwinds, ends its MLflow run KILLED and keeps its checkpoints. Raised inside a write to a sqlite MLflow
store, it can leave that write's transaction open and the store locked for the rest of the process: ending the
run KILLED then waits out sqlite's busy timeout and fails, and the run stays RUNNING. :func:`uninterrupted`
holds such a signal until the block around a store write has finished, then raises it. A Ray worker's own SIGTERM
handler (it raises ``SystemExit`` where the main thread is) is held the same way once wrapped by
:func:`defer_while_writing`.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from typing import Any, Callable, Iterator

_depth = 0  # uninterrupted blocks the main thread is in
# A signal that arrived in one, raised when the outermost ends: its number (the CLI's handler), or the call of a
# wrapped handler (defer_while_writing) that the signal deferred.
_pending: int | Callable[[], Any] | None = None


class Stopped(KeyboardInterrupt):
    """A signal that stops a command (SIGTERM, SIGINT), raised where the main thread is when it arrives."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def interrupt(signum: int, frame: object) -> None:
    """The CLI's handler of SIGTERM and SIGINT: raise :class:`Stopped` now, or at the end of the
    :func:`uninterrupted` block the main thread is in."""
    global _pending
    if _depth:
        _pending = signum
        return
    raise Stopped(signum)


def defer_while_writing(handler: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
    """``handler``, another signal handler (a Ray worker's SIGTERM handler), wrapped so that a signal arriving in an
    :func:`uninterrupted` block runs it when the outermost block ends, not inside the write."""
    def deferring(signum: int, frame: Any) -> Any:
        global _pending
        if _depth:
            _pending = functools.partial(handler, signum, None)
            return None
        return handler(signum, frame)

    deferring.nmtcore_deferring = True  # type: ignore[attr-defined]
    return deferring


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold a stopping signal (see :func:`interrupt`) until the block ends; in threads other than the main one
    (where no signal handler runs) a plain block."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _pending is not None:
            pending, _pending = _pending, None
            if callable(pending):
                pending()
            else:
                raise Stopped(pending)


__all__ = ["Stopped", "defer_while_writing", "interrupt", "uninterrupted"]
