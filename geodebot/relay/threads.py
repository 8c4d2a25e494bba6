"""Which threads exist and whose they are: a thread is a session with its binding(s).

A binding's session is a thread; so is each ``<session>/<thread>`` of a thread-scoped
binding that has had a message. A thread belongs to its bindings' project (a binding without
``project`` is a project of its own, named by its session), and the relay posts into it
through its first binding in config order: that is the thread's adapter, never silently
another.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from geodebot.chat.bindings import BindingIndex, binding_key
from geodebot.config.schema import BindingConfig, RelayConfig
from geodebot.relay.contracts import ThreadId, ThreadLocatorV1
from geodebot.store.protocol import SessionStore

__all__ = ["TERMINAL", "Thread", "ThreadDirectory"]

# The adapter of a terminal chat's thread (geodebot chat).
TERMINAL = "terminal"
# thread_list shows at most this many threads.
MAX_LISTED = 200


@dataclass(frozen=True, slots=True)
class Thread:
    session_id: str
    project: str
    # The binding the relay posts through; None for a terminal chat.
    binding: BindingConfig | None
    # The platform thread of a thread-scoped binding's session, else None.
    platform_thread: str | None
    # Every binding whose chats run on this session (keys).
    links: tuple[str, ...]

    @property
    def adapter(self) -> str:
        return self.binding.platform if self.binding is not None else TERMINAL

    @property
    def key(self) -> str:
        if self.binding is None:
            return f"{TERMINAL}:{self.session_id}"
        key = binding_key(self.binding)
        return f"{key}/{self.platform_thread}" if self.platform_thread else key

    def capability(self, relay: RelayConfig) -> str:
        """Changes with whatever decides what the relay may do with this thread."""
        facts = [
            1,
            self.project,
            self.adapter,
            self.key,
            sorted(self.links),
            relay.enabled,
            relay.max_read_messages,
            relay.max_read_chars,
        ]
        blob = json.dumps(facts, separators=(",", ":"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def locator(self, relay: RelayConfig, *, send: bool) -> ThreadLocatorV1:
        return ThreadLocatorV1(
            adapter=self.adapter,  # type: ignore[arg-type]  # a platform or "terminal"
            project=self.project,
            thread=ThreadId(session_id=self.session_id, thread_key=self.key),
            access_scope="read_send" if send else "read",
            capability_revision=self.capability(relay),
        )


class ThreadDirectory:
    def __init__(
        self, bindings: BindingIndex | Sequence[BindingConfig], terminal_project: str | None
    ) -> None:
        self._index = BindingIndex.of(bindings)
        self._terminal_project = terminal_project

    def locate(self, session_id: str) -> Thread | None:
        """The thread ``session_id`` is, or None if no binding runs on it."""
        found = self._index.with_session(session_id)
        if found:
            return self._thread(session_id, found, None)
        # A thread of a thread-scoped binding: "<session>/<platform thread>".
        cut = session_id.rfind("/")
        while cut > 0:
            base, thread = session_id[:cut], session_id[cut + 1 :]
            scoped = tuple(b for b in self._index.with_session(base) if b.scope == "thread")
            if scoped and thread:
                return self._thread(session_id, scoped, thread)
            cut = session_id.rfind("/", 0, cut)
        return None

    def terminal(self, session_id: str) -> Thread | None:
        """A terminal chat's session as a thread of the terminal's project, if it has one."""
        if self._terminal_project is None:
            return None
        return Thread(session_id, self._terminal_project, None, None, ())

    async def in_project(self, project: str, store: SessionStore) -> list[Thread]:
        """The project's threads: each binding's session, and the threads of thread-scoped
        bindings that have had a message; in config order, at most MAX_LISTED."""
        threads: dict[str, Thread] = {}
        scoped: list[str] = []
        for binding in self._index.all():
            if binding.project_name != project:
                continue
            thread = self.locate(binding.session)
            if thread is not None and thread.project == project:
                threads.setdefault(binding.session, thread)
            if binding.scope == "thread":
                scoped.append(binding.session + "/")
        if scoped:
            for record in await store.list_sessions():
                if len(threads) >= MAX_LISTED:
                    break
                if any(record.id.startswith(prefix) for prefix in scoped):
                    thread = self.locate(record.id)
                    if thread is not None and thread.project == project:
                        threads.setdefault(record.id, thread)
        return list(threads.values())[:MAX_LISTED]

    def _thread(
        self, session_id: str, bindings: Sequence[BindingConfig], platform_thread: str | None
    ) -> Thread:
        first = bindings[0]
        return Thread(
            session_id,
            first.project_name,
            first,
            platform_thread,
            tuple(binding_key(b) for b in bindings),
        )
