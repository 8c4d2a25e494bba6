"""Durable state behind one :class:`Store` protocol (SQLite now, PostgreSQL later)."""

from geodebot.store.protocol import (
    EffectReceipt,
    FinishStatus,
    MessageRecord,
    NewMessage,
    OperatorSwitch,
    ReceiptStatus,
    Resolution,
    SessionRecord,
    Store,
    StoreError,
    TimelineEvent,
    ToolBatchRecord,
)

__all__ = [
    "EffectReceipt",
    "FinishStatus",
    "MessageRecord",
    "NewMessage",
    "OperatorSwitch",
    "ReceiptStatus",
    "Resolution",
    "SessionRecord",
    "Store",
    "StoreError",
    "TimelineEvent",
    "ToolBatchRecord",
]
