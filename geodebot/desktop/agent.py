"""``geodebot desktop-agent``: the only process that touches the X display.

Computer use runs here, in its own service next to an Xvfb display, so the daemon's unit keeps
its hardening (no X socket, no display, no input devices). The daemon reaches it over a unix
socket, one JSON object per line each way::

    {"op": "screenshot"}                               -> {"ok": true, "width", "height", "png"}
    {"op": "click", "x", "y", "button", "double"}      -> {"ok": true}
    {"op": "type", "text"} | {"op": "key", "keys"}     -> {"ok": true}
    {"op": "scroll", "x", "y", "direction", "amount"}  -> {"ok": true}
    {"op": "cursor_position"}                          -> {"ok": true, "x", "y"}
    anything malformed or refused                      -> {"ok": false, "error": "..."}

Input goes through xdotool, screenshots through mss (PNG, base64). Whether a call may happen at
all (operator switch, binding allowlist, DAEMON rules) is decided by the daemon before it asks.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

log = logging.getLogger(__name__)

__all__ = ["DesktopAgent", "DesktopError", "serve_agent"]

MAX_FRAME_BYTES = 64 * 1024
MAX_TEXT_CHARS = 4000
MAX_SCROLL = 50
_COMMAND_TIMEOUT_S = 10.0
# xdotool key names joined by "+" (chords) and spaces (sequences): nothing a shell could read.
_KEYS = re.compile(r"[A-Za-z0-9_]+(?:\+[A-Za-z0-9_]+)*(?: [A-Za-z0-9_]+(?:\+[A-Za-z0-9_]+)*)*")
_BUTTONS = {"left": "1", "middle": "2", "right": "3"}
_WHEEL = {"up": "4", "down": "5", "left": "6", "right": "7"}


class DesktopError(Exception):
    """A refused or failed action; the message goes back to the caller as is."""


class DesktopAgent:
    def __init__(self, display: str) -> None:
        self.display = display
        xdotool = shutil.which("xdotool")
        if xdotool is None:
            raise DesktopError("xdotool is not installed (Debian package xdotool)")
        self._xdotool = xdotool
        self._env = {**os.environ, "DISPLAY": display}

    async def handle(self, request: Mapping[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        ops = {
            "screenshot": self._screenshot_op,
            "cursor_position": self._cursor_position,
            "click": self._click,
            "type": self._type,
            "key": self._key,
            "scroll": self._scroll,
        }
        handler = ops.get(op) if isinstance(op, str) else None
        if handler is None:
            raise DesktopError(f"unknown op {op!r}")
        return await handler(request)

    async def _screenshot_op(self, request: Mapping[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(self._screenshot)

    async def _cursor_position(self, request: Mapping[str, Any]) -> dict[str, Any]:
        out = await self._run("getmouselocation", "--shell")
        fields = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        return {"x": int(fields["X"]), "y": int(fields["Y"])}

    async def _click(self, request: Mapping[str, Any]) -> dict[str, Any]:
        x, y = await self._point(request)
        button = _BUTTONS.get(str(request.get("button", "left")))
        if button is None:
            raise DesktopError(f"button must be one of {sorted(_BUTTONS)}")
        repeat = ["--repeat", "2"] if request.get("double") is True else []
        await self._run("mousemove", "--sync", str(x), str(y), "click", *repeat, button)
        return {}

    async def _type(self, request: Mapping[str, Any]) -> dict[str, Any]:
        text = request.get("text")
        if not isinstance(text, str) or not text or len(text) > MAX_TEXT_CHARS:
            raise DesktopError(f"text must be 1 to {MAX_TEXT_CHARS} characters")
        await self._run("type", "--delay", "1", "--", text)
        return {}

    async def _key(self, request: Mapping[str, Any]) -> dict[str, Any]:
        keys = request.get("keys")
        if not isinstance(keys, str) or not _KEYS.fullmatch(keys):
            raise DesktopError("keys must be xdotool key names such as 'Return' or 'ctrl+c'")
        await self._run("key", "--", *keys.split(" "))
        return {}

    async def _scroll(self, request: Mapping[str, Any]) -> dict[str, Any]:
        x, y = await self._point(request)
        button = _WHEEL.get(str(request.get("direction", "down")))
        amount = request.get("amount", 3)
        if button is None:
            raise DesktopError(f"direction must be one of {sorted(_WHEEL)}")
        if not _is_int(amount) or not 0 < amount <= MAX_SCROLL:
            raise DesktopError(f"amount must be 1 to {MAX_SCROLL}")
        await self._run(
            "mousemove", "--sync", str(x), str(y), "click", "--repeat", str(amount), button
        )
        return {}

    async def _point(self, request: Mapping[str, Any]) -> tuple[int, int]:
        x, y = request.get("x"), request.get("y")
        if not (_is_int(x) and _is_int(y)):
            raise DesktopError("x and y must be integers")
        width, height = (int(v) for v in (await self._run("getdisplaygeometry")).split())
        if not (0 <= x < width and 0 <= y < height):
            raise DesktopError(f"({x}, {y}) is outside the {width}x{height} screen")
        return x, y

    async def _run(self, *args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            self._xdotool,
            *args,
            env=self._env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(_COMMAND_TIMEOUT_S):
                out, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise DesktopError(f"xdotool {args[0]} did not finish") from None
        if proc.returncode != 0:
            raise DesktopError(f"xdotool {args[0]} failed: {err.decode(errors='replace')[:200]}")
        return out.decode(errors="replace")

    def _screenshot(self) -> dict[str, Any]:
        # Imported here: only this process needs it (the `desktop` extra).
        import mss
        import mss.tools

        with mss.mss(display=self.display) as screen:
            shot = screen.grab(screen.monitors[0])
            png = mss.tools.to_png(shot.rgb, shot.size)
        assert png is not None
        return {
            "width": shot.width,
            "height": shot.height,
            "png": base64.b64encode(png).decode(),
        }


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


async def serve_agent(socket_path: Path, agent: DesktopAgent, stop: asyncio.Event) -> None:
    """Answer requests on ``socket_path`` (mode 0660) until ``stop`` is set."""
    path = str(socket_path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = await asyncio.start_unix_server(
        lambda r, w: _client(agent, r, w), path=path, limit=MAX_FRAME_BYTES
    )
    os.chmod(path, 0o660)
    log.info("desktop agent on %s for display %s", socket_path, agent.display)
    async with server:
        await stop.wait()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


async def _client(
    agent: DesktopAgent, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        while line := await reader.readline():
            answer = await _answer(agent, line)
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
    except (ConnectionError, ValueError):
        pass  # gone, or a frame over the limit: the stream is no longer framed
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _answer(agent: DesktopAgent, line: bytes) -> dict[str, Any]:
    try:
        request = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"ok": False, "error": "request is not JSON"}
    if not isinstance(request, dict):
        return {"ok": False, "error": "request is not a JSON object"}
    try:
        return {"ok": True, **await agent.handle(request)}
    except DesktopError as exc:
        return {"ok": False, "error": str(exc)}
    except Exception as exc:
        log.exception("desktop action %r failed", request.get("op"))
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
