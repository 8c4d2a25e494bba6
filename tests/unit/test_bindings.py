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


def test_stored_bindings_join_the_config_ones_and_a_config_binding_of_the_same_chat_wins() -> None:
    stored_solo = b("telegram", "5", "dm:telegram:5")
    paired = b("telegram", "77", "dm:telegram:77")
    index = BindingIndex([X, SOLO], [stored_solo, paired])
    assert index.find("telegram", "5") is SOLO
    assert index.find("telegram", "77") is paired
    assert index.origin("telegram:5") == "config"
    assert index.origin("telegram:77") == "stored"
    assert index.origin("telegram:78") is None
    assert index.shadowed() == (stored_solo,)
    assert index.all() == (X, SOLO, paired)
    assert index.with_session("dm:telegram:77") == (paired,)
    assert index.with_session("dm:telegram:5") == ()


def test_a_replace_swaps_one_part_whole_and_keeps_the_other() -> None:
    paired = b("telegram", "77", "dm:telegram:77")
    index = BindingIndex([X], [paired])
    before = index.find("telegram", "-2001")
    index.replace(config=[SOLO])
    assert index.find("telegram", "-2001") is None
    assert index.find("telegram", "5") is SOLO
    assert index.find("telegram", "77") is paired
    index.replace(stored=[])
    assert index.all() == (SOLO,)
    # What a caller took before the swap is the binding it keeps (a turn under way).
    assert before is X
