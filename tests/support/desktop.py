"""A real Xvfb display with `geodebot desktop-agent` on it, for the computer-use tests.

Xvfb and xdotool are Debian packages (.ci/run installs them); a missing one fails the test.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


async def display_number(read_fd: int, proc: asyncio.subprocess.Process) -> int:
    """The display Xvfb chose (``-displayfd``): it writes the number once it accepts clients.
    Xvfb picks a free one itself, so test processes running side by side never race for
    one."""
    loop = asyncio.get_running_loop()
    with os.fdopen(read_fd, "rb") as pipe:
        async with asyncio.timeout(20):
            line = await loop.run_in_executor(None, pipe.readline)
    if not line.strip():
        await proc.wait()
        raise RuntimeError(f"Xvfb exited with {proc.returncode}")
    return int(line)


async def wait_for(path: Path, proc: asyncio.subprocess.Process, what: str) -> None:
    async with asyncio.timeout(20):
        while not path.exists():
            if proc.returncode is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}")
            await asyncio.sleep(0.05)


@asynccontextmanager
async def running_desktop() -> AsyncIterator[Desktop]:
    xvfb = shutil.which("Xvfb")
    assert xvfb is not None, "Xvfb is needed (Debian package xvfb)"
    assert shutil.which("xdotool") is not None, "xdotool is needed (Debian package xdotool)"
    read_fd, write_fd = os.pipe()
    screen = await asyncio.create_subprocess_exec(
        xvfb,
        "-displayfd",
        str(write_fd),
        "-screen",
        "0",
        f"{WIDTH}x{HEIGHT}x24",
        "-nolisten",
        "tcp",
        # Without it Xvfb resets (pointer included) whenever its last client disconnects.
        "-noreset",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        pass_fds=(write_fd,),
    )
    os.close(write_fd)
    agent = None
    with tempfile.TemporaryDirectory(prefix="gb-desk-") as directory:
        socket = Path(directory) / "agent.sock"
        try:
            number = await display_number(read_fd, screen)
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
