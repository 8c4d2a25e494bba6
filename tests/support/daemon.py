"""``geodebot serve`` as a real subprocess, for end-to-end and crash tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READY_MARK = "geodebot serving"
# Logged once every enabled channel is connected, with READY=1 to systemd.
CONNECTED_MARK = "ready: every enabled channel is connected"
# Logged once the model SDKs are loaded, right after READY.
MODELS_MARK = "models loaded ("


class DaemonProcess:
    """Start with ``await DaemonProcess(config, env).start()``; ``kill()`` is a real SIGKILL."""

    def __init__(self, config: Path, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.env = dict(os.environ if env is None else env)
        self.proc: asyncio.subprocess.Process | None = None
        self.log: list[str] = []
        self._reader: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._mark = READY_MARK

    async def start(self, timeout_s: float = 60.0, *, mark: str = READY_MARK) -> DaemonProcess:
        """Start it and wait for ``mark`` in its log: by default, that it serves."""
        self._ready.clear()
        self._mark = mark
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "geodebot",
            "serve",
            "--config",
            str(self.config),
            cwd=ROOT,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        self._reader = asyncio.create_task(self._read(self.proc))
        waiter = asyncio.create_task(self._ready.wait())
        exited = asyncio.create_task(self.proc.wait())
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.wait({waiter, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            exited.cancel()
        if not self._ready.is_set():
            raise RuntimeError(
                f"geodebot serve did not log {mark!r}:\n" + "\n".join(self.log[-30:])
            )
        return self

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.log.append(line)
            if self._mark in line:
                self._ready.set()

    async def wait_for_line(self, text: str, timeout_s: float = 60.0) -> None:
        """Wait until a log line containing ``text`` has been written."""
        async with asyncio.timeout(timeout_s):
            while not any(text in line for line in self.log):
                if self.proc is not None and self.proc.returncode is not None:
                    raise RuntimeError(f"geodebot serve exited before logging {text!r}")
                await asyncio.sleep(0.02)

    async def kill(self) -> None:
        """kill -9: nothing of the daemon's own shutdown runs."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        await self._reap()

    async def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(timeout_s):
            await self._reap()
        assert self.proc is not None
        assert self.proc.returncode is not None
        return self.proc.returncode

    async def _reap(self) -> None:
        if self.proc is not None:
            await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await self._reader

    def text(self) -> str:
        return "\n".join(self.log)


async def geodebot_status(config: Path, *extra: str) -> tuple[int, str, str]:
    """``geodebot status --config CONFIG *extra`` as a subprocess: (exit code, out, err)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "geodebot",
        "status",
        "--config",
        str(config),
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
