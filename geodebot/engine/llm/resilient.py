"""Retries with backoff, then fallback models, over single-attempt adapters.

Policy, in order of precedence:

* A :class:`TerminalLLMError` is raised at once: no retry and no fallback. A bad request or a
  bad key on the primary must surface, not be papered over by quietly switching models.
* A :class:`TransientLLMError` is retried on the same adapter up to ``max_retries`` times,
  waiting what the provider asked for (``Retry-After``) or an exponential backoff with jitter,
  never more than ``max_retry_wait_s``.
* When an adapter's attempts are used up, the next adapter in the chain gets the request.
  When every adapter is used up, the last transient error is raised.

``on_event`` receives ``("llm_retry", {...})`` before each backoff wait and
``("llm_fallback", {...})`` before each switch, so the loop can put them on the timeline::

    llm_retry:    provider, model, attempt, error, message, wait_s
    llm_fallback: from, to ({"provider", "model"} each), error, message

A streamed call (``on_stream``) passes the listener to every attempt. An attempt that fails
after it streamed text leaves a truncated answer in the chat, so before the retry or fallback
that follows it the listener gets :class:`StreamRestart`: what it showed is void, and the
next attempt's text starts from nothing. When no attempt follows, the raised error says so.

Model ids are passed through untouched: the adapters send exactly the configured id.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from geodebot.engine.llm.errors import LLMRateLimited, TerminalLLMError, TransientLLMError
from geodebot.engine.llm.stream_listener import GuardedListener
from geodebot.engine.llm.types import LLMAdapter, LLMRequest, LLMResponse, StreamListener

log = logging.getLogger(__name__)

EventSink = Callable[[str, dict[str, Any]], None]


class ResilientLLM:
    def __init__(
        self,
        *,
        chain: Sequence[LLMAdapter],
        max_retries: int = 2,
        max_retry_wait_s: float = 30.0,
        base_backoff_s: float = 0.5,
        on_event: EventSink | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not chain:
            raise ValueError("ResilientLLM needs at least one adapter")
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self._chain = tuple(chain)
        self._max_retries = max_retries
        self._max_wait = max(0.0, max_retry_wait_s)
        self._base_backoff = max(0.0, base_backoff_s)
        self._on_event = on_event
        self._sleep = sleep

    @property
    def provider(self) -> str:
        return self._chain[0].provider

    @property
    def model(self) -> str:
        return self._chain[0].model

    @property
    def chain(self) -> tuple[LLMAdapter, ...]:
        return self._chain

    async def complete(
        self, request: LLMRequest, *, on_stream: StreamListener | None = None
    ) -> LLMResponse:
        attempts = _Attempts(on_stream)
        last_error: TransientLLMError | None = None
        for index, adapter in enumerate(self._chain):
            if last_error is not None:
                self._fall_back(self._chain[index - 1], adapter, last_error, attempts)
            for attempt in range(1, self._max_retries + 2):
                try:
                    return await adapter.complete(request, on_stream=attempts.next())
                except TerminalLLMError:
                    raise
                except TransientLLMError as exc:
                    last_error = exc
                    if attempt > self._max_retries:
                        break
                    # A CancelledError here (turn cancelled mid-backoff) propagates untouched.
                    await self._retry(adapter, attempt, exc, attempts)
        assert last_error is not None  # the loop either returned, raised, or set it
        raise last_error

    async def _retry(
        self, adapter: LLMAdapter, attempt: int, error: TransientLLMError, attempts: _Attempts
    ) -> None:
        wait_s = self._wait_s(error, attempt)
        self._emit(
            "llm_retry",
            {
                "provider": adapter.provider,
                "model": adapter.model,
                "attempt": attempt,
                "error": error.kind,
                "message": str(error),
                "wait_s": round(wait_s, 3),
            },
        )
        # Said before the wait, so the chat stops showing a broken answer as soon as it broke.
        attempts.void(f"{error.kind}; retrying {adapter.provider} {adapter.model}")
        await self._sleep(wait_s)

    def _fall_back(
        self,
        previous: LLMAdapter,
        adapter: LLMAdapter,
        error: TransientLLMError,
        attempts: _Attempts,
    ) -> None:
        self._emit(
            "llm_fallback",
            {
                "from": {"provider": previous.provider, "model": previous.model},
                "to": {"provider": adapter.provider, "model": adapter.model},
                "error": error.kind,
                "message": str(error),
            },
        )
        attempts.void(f"{error.kind}; falling back to {adapter.provider} {adapter.model}")

    async def aclose(self) -> None:
        # Close every adapter even if one fails, then report the first failure.
        errors: list[BaseException] = []
        for adapter in self._chain:
            try:
                await adapter.aclose()
            except Exception as exc:  # noqa: BLE001 - collected, re-raised after the loop
                errors.append(exc)
        if errors:
            raise errors[0]

    def _wait_s(self, error: TransientLLMError, attempt: int) -> float:
        retry_after = error.retry_after if isinstance(error, LLMRateLimited) else None
        if retry_after is not None and retry_after > 0:
            return min(retry_after, self._max_wait)
        backoff = self._base_backoff * 2.0 ** (attempt - 1)
        # Jitter spreads out concurrent turns that failed together, so they do not retry in step.
        return min(backoff * random.uniform(0.75, 1.25), self._max_wait)

    def _emit(self, event: str, data: dict[str, Any]) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event, data)
        except Exception:
            # A broken timeline observer must not change whether the model call succeeds.
            log.exception("on_event callback failed for %s", event)


class _Attempts:
    """The listener each attempt of one call streams to, and whether the last attempt
    streamed text that a retry would leave standing."""

    __slots__ = ("_current", "_listener")

    def __init__(self, listener: StreamListener | None) -> None:
        self._listener = listener
        self._current: GuardedListener | None = None

    def next(self) -> GuardedListener | None:
        """The listener for the next attempt; None when the call is not streamed."""
        if self._listener is None:
            return None
        self._current = GuardedListener(self._listener)
        return self._current

    def void(self, reason: str) -> None:
        """Tell the listener the text streamed so far is void, if the last attempt sent any."""
        current, self._current = self._current, None
        if current is not None and current.streamed_text:
            current.restart(reason)
