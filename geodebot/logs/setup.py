"""Logging: one event per line, JSON when stderr is not a terminal, secrets redacted."""

from __future__ import annotations

import json
import logging
import sys
from typing import TextIO

from geodebot.logs.context import current_context
from geodebot.logs.redact import RedactingFilter, Redactor

# These log every request URL at INFO, and a Telegram URL carries the bot token.
_NOISY = (
    "httpx",
    "httpx2",
    "httpcore",
    "httpcore2",
    "aiosqlite",
    "asyncio",
    "anthropic",
    "openai",
    "mcp",
    "telegram",
    "slack_bolt",
    "slack_sdk",
    # discord.py logs interaction tokens (valid for 15 minutes) at DEBUG.
    "discord",
    # A line per job registered at INFO: thousands of jobs would flood the log at start.
    "apscheduler",
)


class JSONFormatter(logging.Formatter):
    """One JSON object per line (journald keeps it whole), with the turn's ids."""

    def format(self, record: logging.LogRecord) -> str:
        row = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            **current_context(),
            "msg": record.getMessage(),
        }
        if record.exc_text:
            row["exc"] = record.exc_text
        return json.dumps(row, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """For a terminal: the usual line, with the turn's ids in brackets."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = current_context()
        if not context:
            return line
        ids = " ".join(f"{k}={v}" for k, v in context.items())
        return f"{line} [{ids}]"


def setup_logging(
    level: str, redactor: Redactor, *, quiet: bool = False, stream: TextIO | None = None
) -> None:
    """One handler on the root logger; its filter redacts every record that reaches it,
    whichever library logged it (PTB logs its base URL, which holds the bot token)."""
    out = sys.stderr if stream is None else stream
    handler = logging.StreamHandler(out)
    handler.addFilter(RedactingFilter(redactor))
    if out.isatty():
        handler.setFormatter(TextFormatter())
    else:
        handler.setFormatter(JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING if quiet else level.upper())
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.WARNING)
