"""Hard token and spend budgets: a model call is made only after its worst case is reserved.

Every model call of a turn (its rounds and its compaction summaries) goes through
:class:`BudgetedLLM`, which the loop wraps around the turn's model client. Before the call it
reserves the call's worst case (the estimated input plus ``max_tokens``, and that many tokens
at the highest prices when a spend limit is set) against every budget that applies: the
daemon's per UTC day, the calling binding's per UTC day, the job run's, the daemon's spend in
US dollars per UTC day. If one of them cannot take it, no call is made and
:class:`BudgetExhausted` says which budget ran out and when it resets. The provider's reported
usage then settles the reservation.

The counters live in the store (see ``store/spend.py``) and the reservation is
committed durably before the call, so a restart forgets nothing and a crash between
reservation and settlement leaves the worst case counted: spent budget is never freed. A call
that got no answer (the provider refused it, the connection failed) is settled at zero.

When no limit applies the call is not held up at all: its row is written after it, and the
counters still count it, so a limit set later sees the day's spend so far.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Self, TypeVar

from geodebot.config.schema import Prices
from geodebot.engine import compaction
from geodebot.engine.llm.errors import LLMError
from geodebot.engine.llm.types import (
    FileBlock,
    LLMAdapter,
    LLMRequest,
    LLMResponse,
    StreamListener,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    canonical_json,
)
from geodebot.store.protocol import SpendStore
from geodebot.store.records import ModelCall, SpendCharge, SpendRefusal, StoreError

log = logging.getLogger(__name__)

__all__ = [
    "AudioBudget",
    "AudioPrices",
    "BudgetExhausted",
    "BudgetedLLM",
    "SpendGate",
    "SpendLimits",
    "SpendScope",
]

_R = TypeVar("_R")

DAEMON = "daemon"
USD = "usd"


@dataclass(frozen=True, slots=True)
class SpendScope:
    """Whose budgets a session's model calls count against (opaque names to the engine)."""

    # The calling binding's key (platform:channel).
    binding: str | None = None
    # The job and its run (the fire), for the per-run limit.
    job: str | None = None
    run: str | None = None


@dataclass(frozen=True, slots=True)
class SpendLimits:
    """The limits, as the composition root reads them from the configuration."""

    daily_tokens: int = 0
    daily_usd: float | None = None
    # binding key -> daily tokens; job id -> tokens per run. Absent or 0: no limit.
    bindings: Mapping[str, int] = field(default_factory=dict)
    jobs: Mapping[str, int] = field(default_factory=dict)
    # (provider, model) -> prices, for the cost of each call.
    prices: Mapping[tuple[str, str], Prices] = field(default_factory=dict)

    @property
    def worst_prices(self) -> tuple[float, float]:
        """The highest input and output prices of any model a call may end up on."""
        known = list(self.prices.values())
        if not known:
            return 0.0, 0.0
        return max(p.highest_input for p in known), max(p.output for p in known)


class BudgetExhausted(LLMError):
    """A budget cannot take the call's worst case: no call was made."""

    def __init__(self, budget: str, detail: str, resets: str) -> None:
        super().__init__(f"{budget} is used up ({detail}); {resets}")
        self.budget = budget
        self.detail = detail
        self.resets = resets

    @property
    def user_message(self) -> str:
        return f"No model call was made: {self.budget} is used up ({self.detail}). {self.resets}"


def _tokens(n: float) -> str:
    return f"{int(n):,}"


def _until(now: float) -> tuple[str, float]:
    """When the UTC day of ``now`` ends: as text, and as a timestamp."""
    today = dt.datetime.fromtimestamp(now, dt.UTC).date()
    midnight = dt.datetime.combine(today + dt.timedelta(days=1), dt.time(), dt.UTC)
    left = max(0, int(midnight.timestamp() - now))
    hours, minutes = divmod(left // 60, 60)
    return f"It resets at 00:00 UTC, in {hours} h {minutes:02d} min.", midnight.timestamp()


def describe(refusal: SpendRefusal, now: float) -> BudgetExhausted:
    charge = refusal.charge
    scope = charge.scope
    limit = charge.limit or 0.0
    if charge.unit == "usd":
        budget = f"the daemon's daily spend budget ([model] daily_usd = ${limit:,.2f})"
        detail = f"${refusal.used:,.4f} spent or reserved, this call could cost up to "
        detail += f"${refusal.needed:,.4f}"
    else:
        if scope == DAEMON:
            budget = f"the daemon's daily token budget ([budgets] daily_tokens = {_tokens(limit)})"
        elif scope.startswith("binding:"):
            key = scope.removeprefix("binding:")
            budget = f"this chat's daily token budget (daily_tokens = {_tokens(limit)} on "
            budget += f"binding {key})"
        else:
            job = scope.removeprefix("job:")
            budget = f"this job run's token budget (max_tokens_per_run = {_tokens(limit)} on "
            budget += f"job {job})"
        detail = f"{_tokens(refusal.used)} tokens used or reserved, this call needs up to "
        detail += _tokens(refusal.needed)
    if scope.startswith("job:"):
        resets = "The job's next run starts with a fresh budget."
    else:
        resets = _until(now)[0]
    return BudgetExhausted(budget, detail, resets)


def estimate_input(request: LLMRequest) -> int:
    """The request's input tokens, estimated as compaction does (about four characters per
    token, a file or an image as one screenshot), the tool schemas included."""
    chars = len(request.system)
    for message in request.messages:
        for block in message.content:
            if isinstance(block, TextBlock):
                chars += len(block.text)
            elif isinstance(block, ToolResultBlock):
                chars += len(block.content) + len(block.images) * compaction.IMAGE_CHARS
            elif isinstance(block, ToolUseBlock):
                chars += len(canonical_json(dict(block.arguments))) + len(block.name)
            elif isinstance(block, FileBlock):
                chars += compaction.IMAGE_CHARS + len(block.data)
    chars += sum(len(t.description) + len(canonical_json(t.input_schema)) for t in request.tools)
    return chars // 4 + 1


@dataclass(frozen=True, slots=True)
class Exhausted:
    """A budget a call was refused on, for ``/healthz``."""

    budget: str
    scope: str
    period: str
    at: float
    resets_at: float | None


class SpendGate:
    """Reserves and settles model calls against the configured budgets; one per daemon."""

    def __init__(
        self, store: SpendStore, limits: SpendLimits, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.limits = limits
        self._clock = clock
        self._refused: dict[str, Exhausted] = {}
        # Settlements under way (see BudgetedLLM.complete); the gate's exit waits for them.
        self._settling: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.settled()

    def settle_soon(self, settling: Coroutine[Any, Any, None]) -> None:
        """Record a call's outcome without its caller waiting for the commit.

        The write is asked for at the loop's next pass, before anything the caller does
        with the answer reaches the store, so it commits together with the turn's next
        write (the group commit keeps their order), in one transaction where there were
        two. What it counts is never less than what was spent: a crash before the commit
        leaves a reservation at its worst case (an unlimited call goes unrecorded)."""
        task = asyncio.ensure_future(settling)
        self._settling.add(task)
        task.add_done_callback(self._settle_done)

    def _settle_done(self, task: asyncio.Task[None]) -> None:
        self._settling.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("recording a model call failed", exc_info=error)

    async def settled(self) -> None:
        """Wait for every settlement asked for so far (before the store closes)."""
        while self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

    def charges(self, scope: SpendScope, day: str) -> list[SpendCharge]:
        limits = self.limits
        found = [SpendCharge(DAEMON, day, "tokens", limits.daily_tokens or None)]
        if scope.binding is not None:
            limit = limits.bindings.get(scope.binding) or None
            found.append(SpendCharge(binding_scope(scope.binding), day, "tokens", limit))
        if scope.job is not None and scope.run is not None:
            limit = limits.jobs.get(scope.job) or None
            found.append(SpendCharge(f"job:{scope.job}", scope.run, "tokens", limit))
        if limits.daily_usd is not None:
            found.append(SpendCharge(USD, day, "usd", limits.daily_usd))
        return found

    def wrap(
        self, llm: LLMAdapter, *, session_id: str, turn_id: str | None, scope: SpendScope
    ) -> BudgetedLLM:
        return BudgetedLLM(llm, self, session_id=session_id, turn_id=turn_id, scope=scope)

    def cost(self, provider: str, model: str, call: ModelCall) -> float | None:
        prices = self.limits.prices.get((provider, model))
        if prices is None:
            return None
        return prices.cost(
            call.input_tokens, call.output_tokens, call.cache_read_tokens, call.cache_write_tokens
        )

    def refused(self, refusal: SpendRefusal, now: float) -> BudgetExhausted:
        error = describe(refusal, now)
        charge = refusal.charge
        resets = None if charge.scope.startswith("job:") else _until(now)[1]
        self._refused[charge.scope] = Exhausted(
            error.budget, charge.scope, charge.period, now, resets
        )
        log.warning("model call refused: %s", error)
        return error

    async def reserve(self, call: ModelCall, charges: list[SpendCharge], now: float) -> bool:
        """Reserve ``call``'s worst case where a limit applies (whether one does); raises
        :class:`BudgetExhausted`, and makes no call, where it does not fit."""
        limited = any(charge.limit is not None for charge in charges)
        if limited:
            refusal = await self.store.spend_reserve(call, charges)
            if refusal is not None:
                raise self.refused(refusal, now)
            self.reserved(charges)
        return limited

    def reserved(self, charges: list[SpendCharge]) -> None:
        """A reservation went through: the budgets it was charged to are not exhausted."""
        for charge in charges:
            self._refused.pop(charge.scope, None)

    async def status(self) -> tuple[bool, dict[str, Any]]:
        """``/healthz``: today's use of every limited budget, and the ones calls were refused
        on. Unhealthy while a daemon-wide budget refuses calls: nothing can answer then."""
        now = self._clock()
        day = utc_day(now)
        limits = self.limits
        budgets: list[tuple[str, str, float]] = []
        if limits.daily_tokens:
            budgets.append((DAEMON, "tokens", float(limits.daily_tokens)))
        if limits.daily_usd is not None:
            budgets.append((USD, "usd", limits.daily_usd))
        for key, tokens in sorted(limits.bindings.items()):
            if tokens:
                budgets.append((binding_scope(key), "tokens", float(tokens)))
        used = await self.store.spend_used([(scope, day) for scope, _, _ in budgets])
        exhausted = [e for e in self._refused.values() if e.resets_at is None or e.resets_at > now]
        return not any(e.scope in (DAEMON, USD) for e in exhausted), {
            "day": day,
            "budgets": [
                {"scope": scope, "unit": unit, "limit": limit, "used": used[(scope, day)]}
                for scope, unit, limit in budgets
            ],
            "exhausted": [
                {"budget": e.budget, "scope": e.scope, "since": e.at, "resets_at": e.resets_at}
                for e in sorted(exhausted, key=lambda e: e.scope)
            ],
        }

    def now(self) -> float:
        return self._clock()


async def settle_call(
    gate: SpendGate,
    call: ModelCall,
    charges: list[SpendCharge],
    limited: bool,
    settled: ModelCall,
) -> None:
    """Write a call's outcome: the settlement of its reservation, or (no limit applied) its
    row, written after the call."""
    store = gate.store
    settled = replace(settled, settled_at=gate.now())
    try:
        if limited:
            await store.spend_settle(settled)
        else:
            await store.spend_record(settled, charges)
    except StoreError as exc:
        # The answer stands; a reservation that could not be settled keeps its worst case
        # (over-counted, never under), an unlimited call goes uncounted.
        log.error("cannot record model call %s: %s", call.id, exc)


AUDIO_PROVIDER = "audio"


@dataclass(frozen=True, slots=True)
class AudioPrices:
    """US dollars per transcribed minute and per million spoken characters ([voice])."""

    per_minute: float | None = None
    per_mchars: float | None = None

    def cost(self, seconds: float, chars: int) -> float | None:
        """None where a price that applies is not set (the call is counted unpriced)."""
        if (seconds and self.per_minute is None) or (chars and self.per_mchars is None):
            return None
        return seconds / 60 * (self.per_minute or 0.0) + chars / 1e6 * (self.per_mchars or 0.0)


class AudioBudget:
    """An audio service's call under the spend budget, as a model call is: its worst case
    (the note's length, the text's characters) is reserved in US dollars first where
    ``daily_usd`` is set, and the call refused (:class:`BudgetExhausted`) if it does not fit;
    what it used settles the reservation. Audio uses no tokens, so no token budget is
    charged. Each call is a ``model_calls`` row of provider ``audio``, so ``geodebot usage``
    counts its seconds and characters."""

    def __init__(self, gate: SpendGate, prices: AudioPrices) -> None:
        self._gate = gate
        self._prices = prices

    async def call(
        self,
        work: Callable[[], Coroutine[Any, Any, _R]],
        *,
        model: str,
        scope: SpendScope,
        session_id: str,
        turn_id: str | None = None,
        seconds: float = 0.0,
        chars: int = 0,
        used_seconds: Callable[[_R], float] | None = None,
    ) -> _R:
        gate = self._gate
        now = gate.now()
        day = utc_day(now)
        charges = [c for c in gate.charges(scope, day) if c.unit == "usd"]
        worst = self._prices.cost(seconds, chars)
        call = ModelCall(
            id=f"ac-{uuid.uuid4().hex[:16]}",
            day=day,
            created_at=now,
            session_id=session_id,
            turn_id=turn_id,
            binding=scope.binding,
            job=scope.job,
            run=scope.run,
            state="reserved",
            reserved_usd=worst or 0.0,
            provider=AUDIO_PROVIDER,
            model=model,
        )
        limited = await gate.reserve(call, charges, now)
        try:
            result = await work()
        except Exception:
            await self._settle(call, charges, limited, replace(call, state="failed"))
            raise
        heard = used_seconds(result) if used_seconds is not None else seconds
        settled = replace(
            call,
            state="settled",
            audio_seconds=heard,
            spoken_chars=chars,
            cost_usd=self._prices.cost(heard, chars),
        )
        await self._settle(call, charges, limited, settled)
        return result

    async def _settle(
        self, call: ModelCall, charges: list[SpendCharge], limited: bool, settled: ModelCall
    ) -> None:
        await settle_call(self._gate, call, charges, limited, settled)


def binding_scope(key: str) -> str:
    """The counter of a binding's daily tokens (its key is ``platform:channel``)."""
    return f"binding:{key}"


def utc_day(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).date().isoformat()


class BudgetedLLM:
    """One turn's model client under the budgets (see the module's docstring)."""

    def __init__(
        self,
        inner: LLMAdapter,
        gate: SpendGate,
        *,
        session_id: str,
        turn_id: str | None,
        scope: SpendScope,
    ) -> None:
        self._inner = inner
        self._gate = gate
        self._session_id = session_id
        self._turn_id = turn_id
        self._scope = scope

    @property
    def provider(self) -> str:
        return self._inner.provider

    @property
    def model(self) -> str:
        return self._inner.model

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def complete(
        self, request: LLMRequest, *, on_stream: StreamListener | None = None
    ) -> LLMResponse:
        gate = self._gate
        now = gate.now()
        day = utc_day(now)
        charges = gate.charges(self._scope, day)
        estimate = (
            request.estimated_input_tokens
            if request.estimated_input_tokens is not None
            else estimate_input(request)
        )
        input_price, output_price = gate.limits.worst_prices
        call = ModelCall(
            id=f"mc-{uuid.uuid4().hex[:16]}",
            day=day,
            created_at=now,
            session_id=self._session_id,
            turn_id=self._turn_id,
            binding=self._scope.binding,
            job=self._scope.job,
            run=self._scope.run,
            state="reserved",
            reserved_tokens=estimate + request.max_tokens,
            reserved_usd=(estimate * input_price + request.max_tokens * output_price) / 1e6,
        )
        limited = await gate.reserve(call, charges, now)
        try:
            response = await self._inner.complete(request, on_stream=on_stream)
        except LLMError:
            # No answer: nothing the provider reports as used.
            gate.settle_soon(self._settle(call, charges, limited, replace(call, state="failed")))
            raise
        except asyncio.CancelledError:
            # Cut off mid-call (the turn's time budget): what it spent is unknown, so a
            # reservation stays as it is, at its worst case.
            raise
        usage = response.usage
        settled = replace(
            call,
            state="settled",
            provider=response.provider,
            model=response.model,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cache_read_tokens=usage.cache_read_tokens,
            cache_write_tokens=usage.cache_write_tokens,
        )
        settled = replace(settled, cost_usd=gate.cost(response.provider, response.model, settled))
        gate.settle_soon(self._settle(call, charges, limited, settled))
        return response

    async def _settle(
        self, call: ModelCall, charges: list[SpendCharge], limited: bool, settled: ModelCall
    ) -> None:
        await settle_call(self._gate, call, charges, limited, settled)
