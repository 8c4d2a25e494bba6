"""run_bash: one shell command in the workspace, in its own session, with a scrubbed environment.

The command runs as the leader of a new process group. Whatever happens (normal exit, its own
timeout, or the authority pipeline cancelling the handler) the whole group is signalled and
the shell is awaited, so no background child outlives the call and no zombie is left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geodebot.engine.tools.builtin.paths import ensure_workspace
from geodebot.engine.tools.spec import (
    Effect,
    Safety,
    ToolCallContext,
    ToolError,
    ToolOutcomeUnknown,
    ToolSpec,
)

if TYPE_CHECKING:
    from geodebot.engine.tools.builtin.settings import BuiltinSettings

MAX_STREAM_BYTES = 64 * 1024
MAX_COMMAND_CHARS = 100_000
KILL_GRACE_S = 2.0
_POLL_S = 0.02
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class _Capture:
    def __init__(self) -> None:
        self.data = bytearray()
        self.total = 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        # Keeps reading past the cap so a chatty command never blocks on a full pipe.
        while chunk := await stream.read(65536):
            self.total += len(chunk)
            room = MAX_STREAM_BYTES - len(self.data)
            if room > 0:
                self.data += chunk[:room]

    def text(self) -> str:
        out = self.data.decode("utf-8", "replace")
        if self.total > len(self.data):
            out += f"\n[truncated: {self.total - len(self.data)} more bytes not shown]"
        return out


def minimal_env(workspace: Path) -> dict[str, str]:
    # Built from scratch: the daemon's own environment holds API keys.
    return {"PATH": SAFE_PATH, "HOME": str(workspace), "LANG": "C.UTF-8"}


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_alive(pgid: int) -> bool:
    """True while a live (non-zombie) process is in the group."""
    if not _signal_group(pgid, 0):
        return False
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # After the command name: state, ppid, pgrp. Orphaned zombies wait for init to reap
        # them (some container inits never do) and cannot be killed anyway.
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


async def _settled(proc: asyncio.subprocess.Process, readers: list[asyncio.Task[None]]) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + KILL_GRACE_S
    while loop.time() < deadline:
        done = proc.returncode is not None and all(r.done() for r in readers)
        # The /proc scan can touch thousands of files; keep it off the event loop.
        if done and not await asyncio.to_thread(_group_alive, proc.pid):
            return True
        await asyncio.sleep(_POLL_S)
    return False


async def _reap(proc: asyncio.subprocess.Process, readers: list[asyncio.Task[None]]) -> None:
    if _signal_group(proc.pid, signal.SIGTERM) and not await _settled(proc, readers):
        _signal_group(proc.pid, signal.SIGKILL)
    await proc.wait()
    _, pending = await asyncio.wait(readers, timeout=KILL_GRACE_S)
    if pending:
        # Only a process that left the group (setsid) can still hold the pipes open.
        for task in pending:
            task.cancel()
        await asyncio.wait(pending)
        transport = getattr(proc, "_transport", None)
        if transport is not None:
            transport.close()


async def run_command(
    command: str, timeout_s: float, workspace: Path, cleanups: set[asyncio.Task[None]]
) -> str:
    """Run ``command``; ``cleanups`` holds the group-kill tasks until they finish.

    Cleanups run as tasks of their own so a second cancellation cannot abandon a half-killed
    group; the caller's set keeps them referenced, since the loop holds tasks only weakly.
    """
    root = await asyncio.to_thread(ensure_workspace, workspace)
    try:
        proc = await asyncio.create_subprocess_exec(
            "/bin/bash",
            "-c",
            command,
            cwd=root,
            env=minimal_env(root),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        raise ToolError(f"cannot start /bin/bash: {exc.strerror or exc}") from None
    assert proc.stdout is not None
    assert proc.stderr is not None
    out, err = _Capture(), _Capture()
    readers = [
        asyncio.create_task(out.drain(proc.stdout)),
        asyncio.create_task(err.drain(proc.stderr)),
    ]
    timed_out = False
    try:
        async with asyncio.timeout(timeout_s):
            await proc.wait()
    except TimeoutError:
        timed_out = True
    finally:
        cleanup = asyncio.create_task(_reap(proc, readers))
        cleanups.add(cleanup)
        cleanup.add_done_callback(cleanups.discard)
        await asyncio.shield(cleanup)
    body = f"--- stdout ---\n{out.text()}\n--- stderr ---\n{err.text()}"
    if timed_out:
        # It ran until it was killed: whatever it changed so far stays changed.
        raise ToolOutcomeUnknown(
            f"command timed out after {timeout_s:g} s; its process group was killed\n{body}"
        )
    code = proc.returncode
    status = f"exit code: {code}" if code is None or code >= 0 else f"killed by signal {-code}"
    return f"{status}\n{body}"


def bash_tool(settings: BuiltinSettings) -> ToolSpec:
    limit = settings.bash_timeout_s
    cleanups: set[asyncio.Task[None]] = set()

    async def run_bash(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        command = arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ToolError("command must be a non-empty string")
        if "\x00" in command or len(command) > MAX_COMMAND_CHARS:
            raise ToolError(f"command must be under {MAX_COMMAND_CHARS} chars with no NUL byte")
        timeout = arguments.get("timeout_s", limit)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise ToolError("timeout_s must be a number")
        if not 0 < timeout <= limit:
            raise ToolError(f"timeout_s must be more than 0 and at most {limit:g}")
        return await run_command(command, float(timeout), settings.workspace, cleanups)

    return ToolSpec(
        name="run_bash",
        description=(
            "Run a command with /bin/bash -c in the workspace (HOME is the workspace; the "
            "environment is minimal; stdin is closed). Returns the exit code, stdout and stderr "
            f"(each capped at 64 KB). Times out after timeout_s (default and max {limit:g} s); "
            "background processes it starts do not outlive it."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "command": {"type": "string", "minLength": 1, "maxLength": MAX_COMMAND_CHARS},
                "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": limit},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
        safety=Safety.DANGEROUS,
        effect=Effect.MUTATE,
        handler=run_bash,
        resource_keys=("fs:workspace",),
        # Leaves room for the group kill after the command's own deadline.
        timeout_s=limit + 2 * KILL_GRACE_S + 3,
        requires_approval=True,
    )
