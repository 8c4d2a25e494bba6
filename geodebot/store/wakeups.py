"""What a store's wake-ups deliver (``Store.wakeups``): an event, with what the wake-ups that
set it named. PostgreSQL sets it from ``LISTEN`` (pg_wakeups.py); SQLite, one process, never."""

from __future__ import annotations

import asyncio

__all__ = ["Wakeups"]


class Wakeups(asyncio.Event):
    """Set at each wake-up of a topic (``Store.wakeups``), with what the wake-ups named
    (``Store.wake(topic, about)``) since they were last taken: a hint, as the wake-up is."""

    def __init__(self) -> None:
        super().__init__()
        self._about: set[str] = set()
        self._unnamed = False

    def heard(self, about: str = "") -> None:
        """A wake-up came; ``about`` empty: it named nothing (or some may have been missed)."""
        if about:
            self._about.add(about)
        else:
            self._unnamed = True
        self.set()

    def take(self) -> tuple[set[str], bool]:
        """(what the wake-ups since the last take named, whether any named nothing), and
        the event cleared."""
        about, unnamed = self._about, self._unnamed
        self._about, self._unnamed = set(), False
        self.clear()
        return about, unnamed
