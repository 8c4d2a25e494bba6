"""Secret redaction for logs, the timeline and the evidence ledger.

Two nets: the exact values of every secret geodebot resolved (API keys, platform tokens), and
patterns for token shapes it may meet without having resolved them (a Telegram URL with
``/bot<token>/``, Slack ``xox*-`` tokens, ``sk-`` keys, bearer headers).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

MASK = "[REDACTED]"

_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(r"(?<=/bot)\d{3,}:[A-Za-z0-9_-]{20,}"),
    re.compile(r"\b\d{6,}:[A-Za-z0-9_-]{30,}\b"),
    re.compile(r"\bxox[abprse]-[A-Za-z0-9-]{10,}"),
    re.compile(r"\bxapp-[A-Za-z0-9-]{10,}"),
    re.compile(r"\bsk-[A-Za-z0-9_-]{16,}"),
    re.compile(r"(?i)(?<=bearer )[A-Za-z0-9._~+/=-]{16,}"),
    re.compile(r"\b[MNO][A-Za-z0-9_-]{23,}\.[A-Za-z0-9_-]{6}\.[A-Za-z0-9_-]{27,}\b"),
)

# Shorter values are too likely to occur by chance in ordinary text.
_MIN_SECRET_LEN = 8


class Redactor:
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets: set[str] = set()
        for secret in secrets:
            self.add(secret)

    def add(self, secret: str | None) -> None:
        if secret and len(secret) >= _MIN_SECRET_LEN:
            self._secrets.add(secret)

    def redact(self, text: str) -> str:
        # Longest first, so a secret containing another is masked whole.
        for secret in sorted(self._secrets, key=len, reverse=True):
            if secret in text:
                text = text.replace(secret, MASK)
        for pattern in _PATTERNS:
            text = pattern.sub(MASK, text)
        return text

    def redact_obj(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, Mapping):
            return {str(k): self.redact_obj(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.redact_obj(v) for v in value]
        return value


class RedactingFilter(logging.Filter):
    """Rewrites every record's message so no handler can print a secret."""

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self._redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self._redactor.redact(record.exc_text)
        record.msg = self._redactor.redact(message)
        record.args = None
        return True
