"""Test doubles that speak real protocols; see each module's docstring for usage."""

from .llm_server import (
    Call,
    Delay,
    Error,
    FakeLLMServer,
    Hang,
    Item,
    Raw,
    RecordedRequest,
    Reply,
)

__all__ = [
    "Call",
    "Delay",
    "Error",
    "FakeLLMServer",
    "Hang",
    "Item",
    "Raw",
    "RecordedRequest",
    "Reply",
]
