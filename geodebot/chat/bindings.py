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

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

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


BindingOrigin = Literal["config", "stored"]


class _Snapshot:
    """One consistent view of every binding: replaced whole, never changed."""

    def __init__(self, config: Sequence[BindingConfig], stored: Sequence[BindingConfig]) -> None:
        by_key: dict[str, BindingConfig] = {}
        origins: dict[str, BindingOrigin] = {}
        for binding in config:
            by_key[binding_key(binding)] = binding
            origins[binding_key(binding)] = "config"
        shadowed: list[BindingConfig] = []
        for binding in stored:
            key = binding_key(binding)
            if key in by_key:
                # The file is the operator's word: a stored binding never overrides it.
                shadowed.append(binding)
                continue
            by_key[key] = binding
            origins[key] = "stored"
        by_session: dict[str, list[BindingConfig]] = {}
        for binding in by_key.values():
            by_session.setdefault(binding.session, []).append(binding)
        self.config = tuple(config)
        self.stored = tuple(stored)
        self.shadowed = tuple(shadowed)
        self.by_key: Mapping[str, BindingConfig] = by_key
        self.origins: Mapping[str, BindingOrigin] = origins
        self.all = tuple(by_key.values())
        self.by_session: Mapping[str, tuple[BindingConfig, ...]] = {
            session: tuple(found) for session, found in by_session.items()
        }


class BindingIndex:
    """Built once by the composition root and shared: a daemon may bind thousands of chats.

    The config file's bindings and those stored at run time (an approved pairing) meet here;
    for one key the config's wins, and the stored one is reported as shadowed. A reload or a
    change in the store swaps the whole view at once (:meth:`replace`), so everyone holding
    the index sees the new bindings from their next look; a turn already running keeps the
    binding it started with."""

    def __init__(
        self, bindings: Iterable[BindingConfig], stored: Iterable[BindingConfig] = ()
    ) -> None:
        self._view = _Snapshot(tuple(bindings), tuple(stored))

    @classmethod
    def of(cls, bindings: BindingIndex | Iterable[BindingConfig]) -> BindingIndex:
        """``bindings`` itself if it is an index already, else an index of them."""
        return bindings if isinstance(bindings, BindingIndex) else cls(bindings)

    def replace(
        self,
        *,
        config: Iterable[BindingConfig] | None = None,
        stored: Iterable[BindingConfig] | None = None,
    ) -> None:
        """Swap in new config bindings, new stored ones, or both (the rest stay)."""
        view = self._view
        self._view = _Snapshot(
            view.config if config is None else tuple(config),
            view.stored if stored is None else tuple(stored),
        )

    def all(self) -> tuple[BindingConfig, ...]:
        """Every binding in force: the config's in its order, then the stored ones."""
        return self._view.all

    def configured(self) -> tuple[BindingConfig, ...]:
        return self._view.config

    def stored(self) -> tuple[BindingConfig, ...]:
        """The stored bindings, shadowed ones included."""
        return self._view.stored

    def shadowed(self) -> tuple[BindingConfig, ...]:
        """Stored bindings a config binding of the same key overrides."""
        return self._view.shadowed

    def origin(self, key: str) -> BindingOrigin | None:
        return self._view.origins.get(key)

    # -- channel -> binding ---------------------------------------------------------------
    def find(self, platform: str, channel: str) -> BindingConfig | None:
        return self._view.by_key.get(f"{platform}:{channel}")

    def by_key(self, key: str) -> BindingConfig | None:
        return self._view.by_key.get(key)

    # -- session -> bindings --------------------------------------------------------------
    def with_session(self, session: str) -> tuple[BindingConfig, ...]:
        """The bindings whose session is exactly ``session``, in config order."""
        return self._view.by_session.get(session, ())


def stored_binding(data: Mapping[str, Any]) -> BindingConfig:
    """A stored binding's table as a binding, checked as a config binding is (raises
    pydantic's ValidationError)."""
    return BindingConfig.model_validate(dict(data))


def calling_binding(index: BindingIndex, ctx: ToolCallContext) -> BindingConfig | None:
    """The binding a tool call came from: the one its origin names, if the call's session is
    that binding's (its session or, for a thread binding, one of its threads)."""
    if ctx.origin is None:
        return None
    binding = index.by_key(ctx.origin)
    if binding is None or not owns(binding, ctx.session_id):
        return None
    return binding
