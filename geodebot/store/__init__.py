"""Durable state behind one :class:`Store` protocol (SQLite now, PostgreSQL later)."""

from geodebot.store.protocol import (
    MessageRecord,
    NewMessage,
    SessionRecord,
    Store,
    StoreError,
    TimelineEvent,
    ToolBatchRecord,
)

__all__ = [
    "MessageRecord",
    "NewMessage",
    "SessionRecord",
    "Store",
    "StoreError",
    "TimelineEvent",
    "ToolBatchRecord",
]
