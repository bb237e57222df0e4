"""The one error tracking raises, and how messages are kept to one line."""

from __future__ import annotations

_TRUNCATED = "...[truncated]"


class TrackingError(RuntimeError):
    """Tracking could not start, or a logging call failed; the message is one line naming the URI."""


def truncate(s: str, limit: int) -> str:
    """``s`` cut to ``limit`` characters, marked as truncated."""
    return s if len(s) <= limit else s[: limit - len(_TRUNCATED)] + _TRUNCATED


def one_line(e: BaseException | str, limit: int = 400) -> str:
    """An exception (or text) as one whitespace-normalised line of at most ``limit`` characters."""
    text = " ".join(str(e).split())
    return truncate(text or type(e).__name__, limit)
