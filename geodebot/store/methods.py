"""Every :class:`~geodebot.store.protocol.Store` method, written once for both stores: the
mixins, on the ``_read`` and ``_write`` a store class provides (see rows.py)."""

from __future__ import annotations

from geodebot.store.approvals import Approvals
from geodebot.store.chat import ChatInboxOutbox
from geodebot.store.deadletters import DeadLetterDecisions
from geodebot.store.fires import JobsAndFires
from geodebot.store.leases import Leases
from geodebot.store.memory import Memory
from geodebot.store.pairing import Pairings
from geodebot.store.receipts import ReceiptsAndSwitches
from geodebot.store.relay import Relay
from geodebot.store.replicas import Replicas
from geodebot.store.sessions import SessionsAndHistory
from geodebot.store.spend import Spend

__all__ = ["StoreMethods"]


class StoreMethods(
    SessionsAndHistory,
    ReceiptsAndSwitches,
    Approvals,
    ChatInboxOutbox,
    DeadLetterDecisions,
    JobsAndFires,
    Leases,
    Memory,
    Pairings,
    Relay,
    Replicas,
    Spend,
):
    """The methods; a store adds its lifecycle (open, close, schema_version) and plumbing."""
