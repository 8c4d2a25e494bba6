"""Bindings both ways: from a platform channel to its binding, and from a session to the
bindings whose chats run on it. Platform-free; the gate, the job tools and the job runner
all look bindings up here, so there is one rule for each direction.

A binding is named by its **key**, ``platform:channel``, unique in a config. Its session is
``binding.session``; a ``scope = "thread"`` binding also owns every ``<session>/<thread>``
(see :func:`geodebot.chat.gate.session_for`). Several bindings may share one session, so
a session names a set of bindings, never one chat: whatever acts for a chat (checks its
tools, posts in it, says what it made) goes by key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from geodebot.config.schema import BindingConfig
from geodebot.engine.tools.spec import ToolCallContext


def binding_key(binding: BindingConfig) -> str:
    return f"{binding.platform}:{binding.channel}"


def owns(binding: BindingConfig, session_id: str) -> bool:
    """Whether a chat of ``binding`` runs on ``session_id``: its session, or one of its
    threads for a thread binding."""
    if session_id == binding.session:
        return True
    return binding.scope == "thread" and session_id.startswith(binding.session + "/")


class BindingIndex:
    """Built once by the composition root and shared: a daemon may bind thousands of chats."""

    def __init__(self, bindings: Iterable[BindingConfig]) -> None:
        by_key: dict[str, BindingConfig] = {}
        by_session: dict[str, list[BindingConfig]] = {}
        for binding in bindings:
            by_key[binding_key(binding)] = binding
            by_session.setdefault(binding.session, []).append(binding)
        self._by_key: Mapping[str, BindingConfig] = by_key
        self._all = tuple(by_key.values())
        self._by_session: Mapping[str, tuple[BindingConfig, ...]] = {
            session: tuple(found) for session, found in by_session.items()
        }

    @classmethod
    def of(cls, bindings: BindingIndex | Iterable[BindingConfig]) -> BindingIndex:
        """``bindings`` itself if it is an index already, else an index of them."""
        return bindings if isinstance(bindings, BindingIndex) else cls(bindings)

    def all(self) -> tuple[BindingConfig, ...]:
        """Every binding, in config order."""
        return self._all

    # -- channel -> binding ---------------------------------------------------------------
    def find(self, platform: str, channel: str) -> BindingConfig | None:
        return self._by_key.get(f"{platform}:{channel}")

    def by_key(self, key: str) -> BindingConfig | None:
        return self._by_key.get(key)

    # -- session -> bindings --------------------------------------------------------------
    def with_session(self, session: str) -> tuple[BindingConfig, ...]:
        """The bindings whose session is exactly ``session``, in config order."""
        return self._by_session.get(session, ())


def calling_binding(index: BindingIndex, ctx: ToolCallContext) -> BindingConfig | None:
    """The binding a tool call came from: the one its origin names, if the call's session is
    that binding's (its session or, for a thread binding, one of its threads)."""
    if ctx.origin is None:
        return None
    binding = index.by_key(ctx.origin)
    if binding is None or not owns(binding, ctx.session_id):
        return None
    return binding
