"""The chat path of an :class:`App` over in-memory channels, wired as the daemon wires it
(:func:`geodebot.chat.pipeline.build_chat`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from geodebot.app.build import App
from geodebot.channels.base import Channel
from geodebot.chat.ownership import LocalOwner, SessionOwner
from geodebot.chat.pipeline import ChatPipeline, build_chat
from geodebot.engine.lanes import Grace

# What a test's pipeline gets to finish its turns, then its sends, as it stops.
TEST_GRACE_S = 1.0


def chat_pipeline(
    app: App,
    channels: Mapping[str, Channel],
    *,
    owner: SessionOwner | None = None,
    **options: Any,
) -> ChatPipeline:
    """``app``'s chat path over ``channels``; ``options`` as :func:`build_chat` takes them.
    One process (:class:`LocalOwner`) unless ``owner`` says otherwise, and a second each to
    drain turns and sends at the end unless the graces are given."""
    options.setdefault("turns_grace", Grace(TEST_GRACE_S))
    options.setdefault("sends_grace", Grace(TEST_GRACE_S))
    return build_chat(
        app.run_turn,
        app.services.store,
        app.bindings,
        channels,
        app.config,
        owner=owner if owner is not None else LocalOwner(),
        files=app.files,
        redactor=app.services.redactor,
        **options,
    )
