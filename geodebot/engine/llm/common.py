"""What both HTTP adapters need to describe a failure the same way."""

from __future__ import annotations

import email.utils
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypedDict

from geodebot.engine.llm.errors import LLMConnectionError, LLMError, LLMInvalidResponse
from geodebot.logs.redact import Redactor

MAX_DETAIL = 300


class Ids(TypedDict):
    provider: str
    model: str


@dataclass(frozen=True, slots=True)
class ErrorText:
    """Builds error messages that name the model and can never carry the API key."""

    provider: str
    model: str
    redactor: Redactor

    def detail(self, text: str) -> str:
        text = self.redactor.redact(" ".join(text.split()))
        if len(text) > MAX_DETAIL:
            text = text[: MAX_DETAIL - 1] + "…"
        return f"{self.provider} {self.model}: {text}"

    def ids(self) -> Ids:
        return {"provider": self.provider, "model": self.model}

    def unfinished_stream(self, *, started: bool, end: str) -> LLMError:
        """A streamed body that ended cleanly without its last event (``end``): not an event
        stream at all if nothing of one came, else an answer cut short that a retry may get."""
        if not started:
            return LLMInvalidResponse(
                self.detail("the response is not an event stream"), **self.ids()
            )
        return LLMConnectionError(self.detail(f"the stream ended before {end}"), **self.ids())


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds the server asked us to wait, from ``retry-after-ms`` or ``retry-after``."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            value = float(millis) / 1000
        except ValueError:
            pass
        else:
            if math.isfinite(value):
                return max(value, 0.0)
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        value = (when - datetime.now(UTC)).total_seconds()
    return max(value, 0.0) if math.isfinite(value) else None


def connection_detail(exc: BaseException) -> str:
    cause = exc.__cause__
    return f"connection failed ({type(cause).__name__}: {cause})" if cause else "connection failed"
