"""The redactor: resolved secrets and token shapes are masked wherever they appear."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from geodebot.logs.redact import _PATTERNS, MASK, Redactor

TOKENS = {  # text: the token in it
    "GET https://api.telegram.org/bot123456:AAAAAAAAAAAAAAAAAAAAAAAA/getMe":
        "123456:AAAAAAAAAAAAAAAAAAAAAAAA",
    "token 1234567:ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123 in text":
        "1234567:ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123",
    "xoxb-1234567890-abcdefghij": "xoxb-1234567890-abcdefghij",
    "app token xapp-1-A1234567890-abcdef": "xapp-1-A1234567890-abcdef",
    "key=sk-ant-api03-abcdefghijklmnop": "sk-ant-api03-abcdefghijklmnop",
    "Authorization: Bearer abcdefghijklmnop.qrstu": "abcdefghijklmnop.qrstu",
    "AUTHORIZATION: BEARER abcdefghijklmnop.qrstu": "abcdefghijklmnop.qrstu",
    "MTAxMjM0NTY3ODkwMTIzNDU2.GhIjKl.abcdefghijklmnopqrstuvwxyz0123":
        "MTAxMjM0NTY3ODkwMTIzNDU2.GhIjKl.abcdefghijklmnopqrstuvwxyz0123",
}  # fmt: skip
SHAPES = list(TOKENS)


def test_every_token_shape_is_masked():
    redactor = Redactor()
    for text, token in TOKENS.items():
        assert redactor.redact(text) == text.replace(token, MASK)
    assert redactor.redact("a plain sentence: 12:30, sk-short") == (
        "a plain sentence: 12:30, sk-short"
    )


def test_resolved_secrets_are_masked_longest_first():
    redactor = Redactor(["hunter2hunter2", "hunter2hunter2-and-more", "short"])
    assert redactor.redact("x hunter2hunter2-and-more y hunter2hunter2 z") == (
        f"x {MASK} y {MASK} z"
    )
    assert redactor.redact("short stays: too short to be a secret") == (
        "short stays: too short to be a secret"
    )
    redactor.add("hunter2hunter2")  # again: no change
    assert redactor.redact_obj({"k": ["hunter2hunter2", 3]}) == {"k": [MASK, 3]}


def one_pattern_at_a_time(text: str) -> str:
    for pattern in _PATTERNS:
        text = re.sub(pattern, MASK, text)
    return text


fragments = st.sampled_from(
    [*SHAPES, " ", "/", ":", ".", "-", "bot", "Bearer ", "sk-", "xoxb-", "123456789",
     "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abc", "M", "é", "\n"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(fragments, max_size=12).map("".join))
def test_one_scan_masks_what_one_pattern_at_a_time_does(text: str):
    # The combined expression may stop a shape at a different place only where two shapes
    # overlap; what is masked must never be less.
    combined = Redactor().redact(text)
    sequential = one_pattern_at_a_time(text)
    assert combined.count(MASK) >= 1 or sequential == text
    left = combined.replace(MASK, "\0")
    assert one_pattern_at_a_time(left) == left  # nothing shaped like a token is left
