"""The Pairing page: requests from people no binding allows, and the bindings stored at run
time, with the same decisions as ``geodebot pairing`` and ``geodebot bindings remove`` (the
one :class:`~geodebot.chat.pairing.PairingDecisions`)."""

from __future__ import annotations

from dataclasses import dataclass

from geodebot.chat.pairing import PairingDecisions, format_code
from geodebot.chat.stored_bindings import binding_listing
from geodebot.ops.console.parts import ConsoleParts, pairing_config
from geodebot.store.records import PairingRecord

__all__ = ["PairingView", "RequestLine", "decisions_of", "pairing_view"]

# Decided and expired requests shown below the waiting ones.
RECENT = 20


@dataclass(frozen=True, slots=True)
class RequestLine:
    record: PairingRecord
    code: str
    state: str


@dataclass(frozen=True, slots=True)
class PairingView:
    enabled: bool
    waiting: list[RequestLine]
    recent: list[RequestLine]
    bindings: list[dict[str, object]]
    grants: tuple[str, ...]


def decisions_of(parts: ConsoleParts) -> PairingDecisions:
    return PairingDecisions(parts.store, pairing_config(parts), ledger=parts.ledger)


async def pairing_view(parts: ConsoleParts) -> PairingView:
    now = parts.clock()
    config = pairing_config(parts)
    lines = [
        RequestLine(r, format_code(r.code), r.state(now)) for r in await parts.store.pairings()
    ]
    rows = binding_listing(parts.bindings.configured(), await parts.store.stored_bindings())
    return PairingView(
        enabled=config.enabled,
        waiting=[line for line in lines if line.state == "pending"],
        recent=[line for line in lines if line.state != "pending"][:RECENT],
        bindings=[row for row in rows if row["origin"] != "config"],
        grants=config.tools,
    )
