"""What the console is handed by the composition root: the daemon's own objects. The
console keeps nothing of its own; every page reads these, every action goes through them."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from geodebot.chat.approvals import ChatApprovals
from geodebot.chat.bindings import BindingIndex, owns
from geodebot.chat.deadletters import DeadLetters
from geodebot.config.schema import BindingConfig, Config, PairingConfig
from geodebot.engine.ledger import EvidenceLedger
from geodebot.engine.tools.registry import ToolRegistry
from geodebot.ops.console.live import LiveFeed
from geodebot.relay.tools import ThreadRelay
from geodebot.store.protocol import Store

# The name actions are recorded under: the console knows no person, only that whoever
# passed its token (or sits at the loopback address) acted through it.
OPERATOR = "operator"

SpendStatus = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]


@dataclass(frozen=True, slots=True)
class ConsoleParts:
    store: Store
    config: Config
    bindings: BindingIndex
    # Every built-in and chat tool (MCP tools are resolved when a turn starts).
    registry: ToolRegistry
    live: LiveFeed
    # The chat cards' owner: a decision made here wakes the waiting turn and edits its card.
    approvals: ChatApprovals | None = None
    # Today's token and spend budgets, when the daemon keeps any.
    spend_status: SpendStatus | None = None
    # Thread Relay: the operator sends a run's result into another thread of its project.
    relay: ThreadRelay | None = None
    # The daemon's dead letters: a replay made here reaches its router or outbox at once.
    deadletters: DeadLetters | None = None
    # Where pairing decisions and memory forgets made here are recorded, as the CLI's are.
    ledger: EvidenceLedger | None = None
    # Reads the stored bindings in now: a binding approved here is in force at once.
    refresh_bindings: Callable[[], Awaitable[object]] | None = None
    # The [pairing] table in force (a reload may change it); None: the config's.
    pairing_config: Callable[[], PairingConfig] | None = None
    clock: Callable[[], float] = time.time


def pairing_config(parts: ConsoleParts) -> PairingConfig:
    return parts.pairing_config() if parts.pairing_config is not None else parts.config.pairing


def binding_of(index: BindingIndex, session_id: str) -> BindingConfig | None:
    """The first binding (in config order) whose chat runs on ``session_id``: its own
    session, or one of its threads for a thread binding."""
    found = index.with_session(session_id)
    if found:
        return found[0]
    # A thread's session is "<binding session>/<thread>", and a binding's session may hold
    # a "/" itself: every prefix is a candidate.
    at = session_id.find("/")
    while at > 0:
        head = session_id[:at]
        for binding in index.with_session(head):
            if owns(binding, session_id):
                return binding
        at = session_id.find("/", at + 1)
    return None


def when(ts: float | None) -> str:
    """A moment as the console shows it (UTC, to the second); "-" for none."""
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
