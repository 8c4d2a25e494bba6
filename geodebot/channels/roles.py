"""What a platform adapter's thin channel class hands to its role objects unchanged.

Each platform package (telegram/, slack/, discord/) builds its roles around one shared state:
taking in (``ingest``), sending (``sender``), approval cards (``cards``) and files
(``files``). :class:`RoleChannel` holds the calls every platform passes straight to one of
them, so a platform's ``channel.py`` says only what differs: how it is built, what it sends,
whether it can look a sent message up, and its status.
"""

from __future__ import annotations

from typing import Protocol

from geodebot.channels.base import (
    ApprovalCard,
    Destination,
    InboundFile,
    InboundSink,
    PressSink,
    SentPart,
)
from geodebot.channels.render import render_for

__all__ = ["RoleChannel"]


class IngestRole(Protocol):
    async def start(self, sink: InboundSink, presses: PressSink | None) -> None: ...

    async def stop(self) -> None: ...


class SenderRole(Protocol):
    async def delete(self, destination: Destination, message_id: str) -> None: ...

    async def typing(self, destination: Destination) -> None: ...


class CardsRole(Protocol):
    async def send_card(self, destination: Destination, card: ApprovalCard) -> SentPart: ...

    async def edit_card(
        self, destination: Destination, message_id: str, card: ApprovalCard
    ) -> None: ...


class FilesRole(Protocol):
    async def download(self, file: InboundFile, max_bytes: int) -> bytes: ...


class RoleChannel:
    """Base of the platform channels: ``_ingest``, ``_sender``, ``_cards`` and ``_files`` are
    set by the subclass's constructor; ``platform`` names the renderer."""

    _ingest: IngestRole
    _sender: SenderRole
    _cards: CardsRole
    _files: FilesRole

    @property
    def platform(self) -> str:
        raise NotImplementedError

    async def start(self, sink: InboundSink, presses: PressSink | None = None) -> None:
        await self._ingest.start(sink, presses)

    async def stop(self) -> None:
        await self._ingest.stop()

    def render(self, markdown: str) -> list[str]:
        return render_for(self.platform, markdown)

    async def download(self, file: InboundFile, max_bytes: int) -> bytes:
        return await self._files.download(file, max_bytes)

    async def send_card(self, destination: Destination, card: ApprovalCard) -> SentPart:
        return await self._cards.send_card(destination, card)

    async def edit_card(
        self, destination: Destination, message_id: str, card: ApprovalCard
    ) -> None:
        await self._cards.edit_card(destination, message_id, card)

    async def delete(self, destination: Destination, message_id: str) -> None:
        await self._sender.delete(destination, message_id)

    async def typing(self, destination: Destination) -> None:
        await self._sender.typing(destination)
