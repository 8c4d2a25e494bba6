"""Who a log line is about: session, platform and turn ids carried by the running task.

A ``ContextVar`` rather than arguments threaded through every call: asyncio copies the
context into each task it creates, so a line logged anywhere inside a turn (an SDK's
included) carries the ids the turn set, and lines of concurrent turns never mix them up.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType

__all__ = ["current_context", "log_context"]

_EMPTY: Mapping[str, str] = MappingProxyType({})
_CONTEXT: ContextVar[Mapping[str, str]] = ContextVar("geodebot_log_context", default=_EMPTY)


@contextmanager
def log_context(**fields: str | None) -> Iterator[None]:
    """Add ``fields`` (None ones skipped) to every line logged inside the block."""
    merged = {**_CONTEXT.get(), **{k: v for k, v in fields.items() if v is not None}}
    token = _CONTEXT.set(MappingProxyType(merged))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_context() -> Mapping[str, str]:
    return _CONTEXT.get()
