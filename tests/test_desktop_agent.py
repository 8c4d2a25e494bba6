"""`geodebot desktop-agent` on a real Xvfb display: xdotool input, mss screenshots, and refusals
for anything malformed. (.ci/run installs xvfb and xdotool.)"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

WIDTH, HEIGHT = 640, 480


@dataclass
class Desktop:
    display: str
    socket: Path

    async def ask(self, **request: Any) -> dict[str, Any]:
        reader, writer = await asyncio.open_unix_connection(str(self.socket))
        try:
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            answer: dict[str, Any] = json.loads(await reader.readline())
            return answer
        finally:
            writer.close()
            await writer.wait_closed()

    async def raw(self, *lines: bytes) -> list[dict[str, Any]]:
        reader, writer = await asyncio.open_unix_connection(str(self.socket))
        try:
            answers = []
            for line in lines:
                writer.write(line)
                await writer.drain()
                answers.append(json.loads(await reader.readline()))
            return answers
        finally:
            writer.close()
            await writer.wait_closed()


def free_display() -> int:
    for number in range(90, 200):
        if (
            not Path(f"/tmp/.X11-unix/X{number}").exists()
            and not Path(f"/tmp/.X{number}-lock").exists()
        ):
            return number
    raise RuntimeError("no free X display number")


async def wait_for(path: Path, proc: asyncio.subprocess.Process, what: str) -> None:
    async with asyncio.timeout(20):
        while not path.exists():
            if proc.returncode is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}")
            await asyncio.sleep(0.05)


@pytest.fixture
async def desktop() -> AsyncIterator[Desktop]:
    xvfb = shutil.which("Xvfb")
    assert xvfb is not None, "Xvfb is needed (Debian package xvfb)"
    assert shutil.which("xdotool") is not None, "xdotool is needed (Debian package xdotool)"
    number = free_display()
    screen = await asyncio.create_subprocess_exec(
        xvfb,
        f":{number}",
        "-screen",
        "0",
        f"{WIDTH}x{HEIGHT}x24",
        "-nolisten",
        "tcp",
        # Without it Xvfb resets (pointer included) whenever its last client disconnects.
        "-noreset",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    agent = None
    with tempfile.TemporaryDirectory(prefix="gb-desk-") as directory:
        socket = Path(directory) / "agent.sock"
        try:
            await wait_for(Path(f"/tmp/.X11-unix/X{number}"), screen, "Xvfb")
            agent = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "geodebot",
                "desktop-agent",
                "--socket",
                str(socket),
                "--display",
                f":{number}",
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            await wait_for(socket, agent, "desktop-agent")
            yield Desktop(f":{number}", socket)
        finally:
            for proc in (agent, screen):
                if proc is not None and proc.returncode is None:
                    proc.terminate()
                    await proc.wait()
    assert agent is not None
    assert agent.returncode == 0  # SIGTERM is a clean stop
    assert not socket.exists()


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
