"""The binding index, both ways: channel or key to binding, session to bindings."""

from __future__ import annotations

from geodebot.chat.bindings import BindingIndex, binding_key, owns
from geodebot.config.schema import BindingConfig


def b(platform: str, channel: str, session: str, scope: str = "channel") -> BindingConfig:
    return BindingConfig.model_validate(
        {"platform": platform, "channel": channel, "session": session, "scope": scope}
    )


X = b("telegram", "-2001", "ops")
Y = b("slack", "C2", "ops", "thread")
DEV = b("slack", "C9", "dev", "thread")
NESTED = b("discord", "77", "team/a", "thread")
SOLO = b("telegram", "5", "solo")
INDEX = BindingIndex([X, Y, DEV, NESTED, SOLO])


def test_channel_and_key_name_one_binding() -> None:
    assert binding_key(X) == "telegram:-2001"
    assert INDEX.find("telegram", "-2001") is X
    assert INDEX.by_key("slack:C2") is Y
    assert INDEX.find("slack", "-2001") is None
    assert INDEX.by_key("ops") is None


def test_a_session_names_every_binding_that_has_it_in_config_order() -> None:
    assert INDEX.with_session("ops") == (X, Y)
    assert INDEX.with_session("solo") == (SOLO,)
    assert INDEX.with_session("nobody") == ()
    # Exact: a thread session is not a binding's session.
    assert INDEX.with_session("dev/171.2") == ()


def test_a_thread_session_belongs_to_its_thread_binding_only() -> None:
    assert owns(Y, "ops/1")
    assert not owns(X, "ops/1")
    assert not owns(DEV, "devops/1")
