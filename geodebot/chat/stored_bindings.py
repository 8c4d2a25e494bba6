"""The bindings made at run time, kept current in the daemon's one ``BindingIndex``.

An operator stores or removes a binding from another process (``geodebot pairing approve``,
``geodebot bindings remove``, the console). Every such change raises one counter in the store
in the same transaction; :class:`StoredBindings` reads that counter every ``poll_s`` (and at
once on a PostgreSQL wake-up about it), and when it moved, reads the bindings again and swaps
them into the index whole. A stored binding that no longer validates (a tool since removed
from the daemon, say) is left out and logged, not half-used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Protocol

from pydantic import ValidationError

from geodebot.chat.bindings import BindingIndex, binding_key, stored_binding
from geodebot.config.schema import BindingConfig
from geodebot.store.pairing import BINDINGS_TOPIC, PairingStore
from geodebot.store.protocol import WakeStore
from geodebot.store.records import StoredBinding, StoreError

__all__ = [
    "POLL_S",
    "StoredBindings",
    "StoredBindingsStore",
    "binding_listing",
    "valid_bindings",
]

log = logging.getLogger(__name__)

# How often the store's counter is read: a change is in force within this (sooner on
# PostgreSQL, whose wake-up comes at once).
POLL_S = 1.0


class StoredBindingsStore(PairingStore, WakeStore, Protocol):
    """The stored bindings, and the wake-ups about them."""


def valid_bindings(rows: list[StoredBinding]) -> tuple[list[BindingConfig], list[str]]:
    """The rows that are bindings (checked as config bindings are), and one line per row that
    is not."""
    found: list[BindingConfig] = []
    problems: list[str] = []
    for row in rows:
        try:
            binding = stored_binding(row.data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            problems.append(f"stored binding {row.key}: {where}: {first['msg']}")
            continue
        if binding_key(binding) != row.key:
            problems.append(f"stored binding {row.key}: its table names {binding_key(binding)}")
            continue
        found.append(binding)
    return found, problems


class StoredBindings:
    """``async with`` it: entering loads the stored bindings into ``index`` (so the first
    message already finds them), then a task follows their changes until left.
    ``on_change`` is called after each swap (the outbox looks for the welcome then)."""

    def __init__(
        self,
        store: StoredBindingsStore,
        index: BindingIndex,
        *,
        poll_s: float = POLL_S,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        self._index = index
        self._poll_s = poll_s
        self._on_change = on_change
        self._revision: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def __aenter__(self) -> StoredBindings:
        await self.refresh()
        self._task = asyncio.create_task(self._follow())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def refresh(self, *, force: bool = False) -> bool:
        """Read the bindings again if the store's counter moved (or ``force``); whether the
        index changed."""
        revision = await self._store.stored_bindings_revision()
        if revision == self._revision and not force:
            return False
        rows = await self._store.stored_bindings()
        bindings, problems = valid_bindings(rows)
        for problem in problems:
            log.error("%s; it is not in force", problem)
        before = {binding_key(b) for b in self._index.stored()}
        self._index.replace(stored=bindings)
        self._revision = revision
        after = {binding_key(b) for b in bindings}
        for key in sorted(after - before):
            log.info("binding %s stored: in force", key)
        for key in sorted(before - after):
            log.info("binding %s removed from the store: no longer in force", key)
        for shadowed in self._index.shadowed():
            if binding_key(shadowed) in after - before:
                log.warning(
                    "stored binding %s is shadowed by the config's binding of that chat",
                    binding_key(shadowed),
                )
        if self._on_change is not None:
            self._on_change()
        return True

    async def _follow(self) -> None:
        async with self._store.wakeups(BINDINGS_TOPIC) as woken:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll_s):
                        await woken.wait()
                woken.take()
                try:
                    await self.refresh()
                except StoreError as exc:
                    if not self._failing:
                        log.error("stored bindings: cannot read them (%s); trying again", exc)
                    self._failing = True
                else:
                    self._failing = False


def binding_listing(
    config: Sequence[BindingConfig], stored: list[StoredBinding]
) -> list[dict[str, Any]]:
    """Every binding with its origin (``geodebot bindings list``, the console): the
    config's first, then the stored ones (shadowed, or invalid, if so)."""
    valid, problems = valid_bindings(stored)
    index = BindingIndex(config, valid)
    shadowed = {binding_key(b) for b in index.shadowed()}
    rows = {s.key: s for s in stored}

    def row(binding: BindingConfig, origin: str) -> dict[str, Any]:
        key = binding_key(binding)
        found = rows.get(key) if origin != "config" else None
        return {
            "key": key,
            "origin": origin,
            "session": binding.session,
            "allowed_users": list(binding.allowed_users),
            "tools": list(binding.tools),
            "made_by": found.origin if found is not None else "",
            "created_by": found.created_by if found is not None else "",
            "created_at": found.created_at if found is not None else None,
            "problem": "",
        }

    listed = [row(b, "config") for b in index.configured()]
    for binding in index.stored():
        key = binding_key(binding)
        listed.append(row(binding, "stored, shadowed" if key in shadowed else "stored"))
    for problem in problems:
        key = problem.split(":", 2)[0].removeprefix("stored binding ")
        listed.append({"key": key, "origin": "stored, invalid", "problem": problem})
    return listed
