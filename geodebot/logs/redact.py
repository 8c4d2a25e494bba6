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

_PATTERNS: tuple[str, ...] = (
    r"(?<=/bot)\d{3,}:[A-Za-z0-9_-]{20,}",
    r"\b\d{6,}:[A-Za-z0-9_-]{30,}\b",
    r"\bxox[abprse]-[A-Za-z0-9-]{10,}",
    r"\bxapp-[A-Za-z0-9-]{10,}",
    r"\bsk-[A-Za-z0-9_-]{16,}",
    r"(?<=(?i:bearer) )[A-Za-z0-9._~+/=-]{16,}",
    r"\b[MNO][A-Za-z0-9_-]{23,}\.[A-Za-z0-9_-]{6}\.[A-Za-z0-9_-]{27,}\b",
)
# One scan of the text for all of them rather than one per pattern: every log line, ledger
# row and timeline string passes through here.
_TOKEN_SHAPES = re.compile("|".join(f"(?:{p})" for p in _PATTERNS))

# Shorter values are too likely to occur by chance in ordinary text.
_MIN_SECRET_LEN = 8


class Redactor:
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets: tuple[str, ...] = ()
        for secret in secrets:
            self.add(secret)

    def add(self, secret: str | None) -> None:
        if secret and len(secret) >= _MIN_SECRET_LEN and secret not in self._secrets:
            # Longest first, so a secret containing another is masked whole.
            self._secrets = tuple(sorted((*self._secrets, secret), key=len, reverse=True))

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return _TOKEN_SHAPES.sub(MASK, text)

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
