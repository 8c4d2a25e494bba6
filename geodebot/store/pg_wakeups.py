"""Wake-ups between processes that share a PostgreSQL store: ``LISTEN``/``NOTIFY``.

A replica that commits something another replica should act on soon (a message a standing-by
replica received, for the serving one to take up) calls :meth:`PgWakeups.wake`; the one that
acts keeps :meth:`PgWakeups.wakeups` open and looks as soon as its event is set. A wake-up is
only a hint: the store is the truth, and whoever waits looks by itself now and then too, so a
lost notification (a dropped listening connection, a wake that failed) delays, never loses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import psycopg

from geodebot.store.postgres_commit import reason
from geodebot.store.records import StoreError
from geodebot.store.wakeups import Wakeups

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

__all__ = ["PgWakeups"]

log = logging.getLogger(__name__)

_TOPIC = re.compile(r"[a-z][a-z_]{0,40}")
# PostgreSQL's payload limit is 8000 bytes; what names a session is far shorter.
_MAX_ABOUT = 1000
# After the listening connection failed: the next try, doubling up to the longest.
_RELISTEN_FIRST_S, _RELISTEN_MAX_S = 0.5, 10.0


def _channel(topic: str) -> str:
    if not _TOPIC.fullmatch(topic):
        raise ValueError(f"a wake-up topic is lower-case letters and _: {topic!r}")
    return f"geodebot_{topic}"


class PgWakeups:
    """A mixin of :class:`PostgresStore` (which provides the connection plumbing)."""

    url: str

    if TYPE_CHECKING:

        def _opened(self, what: str) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]: ...

        def _connect_kwargs(self) -> dict[str, Any]: ...

    async def wake(self, topic: str, about: str = "") -> None:
        """Tell every process listening on ``topic`` to look now, at ``about`` if given."""
        what = f"waking {topic!r}"
        channel = _channel(topic)
        if len(about.encode()) > _MAX_ABOUT:
            about = ""  # too long to name: the listeners look at everything instead
        try:
            async with self._opened(what).connection() as conn:
                await conn.execute("SELECT pg_notify(%s, %s)", (channel, about))
        except psycopg.Error as exc:
            raise StoreError(f"{what} failed: {reason(exc)}") from exc

    @contextlib.asynccontextmanager
    async def wakeups(self, topic: str) -> AsyncIterator[Wakeups]:
        """An event set at each :meth:`wake` of ``topic`` by any process, and each time the
        listening connection is made again (what came meanwhile was not heard: a wake-up
        that names nothing)."""
        channel = _channel(topic)
        event = Wakeups()
        listening = asyncio.create_task(self._listen(channel, event), name=f"listen-{topic}")
        try:
            yield event
        finally:
            listening.cancel()
            await asyncio.gather(listening, return_exceptions=True)

    async def _listen(self, channel: str, event: Wakeups) -> None:
        pause = _RELISTEN_FIRST_S
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(self.url, **self._connect_kwargs())
                async with conn:
                    await conn.execute(f"LISTEN {channel}")
                    event.heard()
                    pause = _RELISTEN_FIRST_S
                    async for notify in conn.notifies():
                        event.heard(notify.payload)
            except psycopg.Error as exc:
                log.warning(
                    "store: listening on %s failed (%s); again in %.1f s",
                    channel,
                    reason(exc),
                    pause,
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, _RELISTEN_MAX_S)
