"""`geodebot desktop-agent` on a real Xvfb display: xdotool input, mss screenshots, and refusals
for anything malformed. (.ci/run installs xvfb and xdotool.)"""

from __future__ import annotations

import base64
import os
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.support.desktop import HEIGHT, WIDTH, Desktop, running_desktop


@pytest.fixture
async def desktop() -> AsyncIterator[Desktop]:
    async with running_desktop() as running:
        yield running


async def test_clicks_and_scrolls_move_the_real_pointer(desktop: Desktop) -> None:
    assert await desktop.ask(op="click", x=123, y=45) == {"ok": True}
    assert await desktop.ask(op="cursor_position") == {"ok": True, "x": 123, "y": 45}
    assert await desktop.ask(op="click", x=300, y=200, button="right", double=True) == {"ok": True}
    assert await desktop.ask(op="scroll", x=10, y=20, direction="down", amount=3) == {"ok": True}
    assert await desktop.ask(op="cursor_position") == {"ok": True, "x": 10, "y": 20}
    assert await desktop.ask(op="type", text="hello; rm -rf / $(x)") == {"ok": True}
    assert await desktop.ask(op="key", keys="ctrl+a BackSpace") == {"ok": True}


async def test_a_screenshot_is_a_png_of_the_whole_screen(desktop: Desktop) -> None:
    answer = await desktop.ask(op="screenshot")
    assert answer["ok"] is True
    assert (answer["width"], answer["height"]) == (WIDTH, HEIGHT)
    png = base64.b64decode(answer["png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (WIDTH, HEIGHT)  # the IHDR chunk


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        ({"op": "click", "x": WIDTH, "y": 0}, "outside the 640x480 screen"),
        ({"op": "click", "x": -1, "y": 5}, "outside"),
        ({"op": "click", "x": "10", "y": 5}, "x and y must be integers"),
        ({"op": "click", "x": True, "y": 5}, "x and y must be integers"),
        ({"op": "click", "x": 1, "y": 1, "button": "fourth"}, "button must be one of"),
        ({"op": "key", "keys": "ctrl+c; reboot"}, "keys must be xdotool key names"),
        ({"op": "key", "keys": "--help"}, "keys must be xdotool key names"),
        ({"op": "type", "text": ""}, "text must be 1 to 4000 characters"),
        ({"op": "type", "text": "x" * 4001}, "text must be 1 to 4000 characters"),
        ({"op": "scroll", "x": 1, "y": 1, "amount": 0}, "amount must be 1 to 50"),
        ({"op": "scroll", "x": 1, "y": 1, "direction": "sideways"}, "direction must be one of"),
        ({"op": "format_disk"}, "unknown op 'format_disk'"),
    ],
)
async def test_bad_requests_are_refused_and_nothing_moves(
    desktop: Desktop, request_: dict[str, Any], error: str
) -> None:
    assert await desktop.ask(op="click", x=5, y=6) == {"ok": True}
    answer = await desktop.ask(**request_)
    assert answer["ok"] is False
    assert error in answer["error"]
    assert await desktop.ask(op="cursor_position") == {"ok": True, "x": 5, "y": 6}


async def test_garbage_frames_get_an_error_and_the_connection_goes_on(desktop: Desktop) -> None:
    answers = await desktop.raw(b"not json\n", b"[1, 2]\n", b'{"op": "cursor_position"}\n')
    assert answers[0] == {"ok": False, "error": "request is not JSON"}
    assert answers[1] == {"ok": False, "error": "request is not a JSON object"}
    assert answers[2]["ok"] is True


def test_the_socket_is_not_open_to_others(desktop: Desktop) -> None:
    assert os.stat(desktop.socket).st_mode & 0o777 == 0o660
