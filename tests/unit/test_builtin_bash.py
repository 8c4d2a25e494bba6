"""run_bash: output, environment, and that no process outlives a call."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from geodebot.engine.modes import Mode
from geodebot.engine.tools import Effect, Safety, ToolCallContext, ToolError, ToolSpec
from geodebot.engine.tools.builtin import BuiltinSettings
from geodebot.engine.tools.builtin.bash import KILL_GRACE_S, MAX_STREAM_BYTES, bash_tool

CTX = ToolCallContext(session_id="s", turn_id="t", mode=Mode.IPC)
# Leaves a grandchild in the background, records both pids, then blocks.
SPAWNER = "sleep 300 & echo $! > grandchild.pid; echo $$ > shell.pid; sleep 300"


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    return tmp_path / "ws"


@pytest.fixture
def spec(ws: Path) -> ToolSpec:
    return bash_tool(BuiltinSettings(workspace=ws, bash_timeout_s=10))


async def run(spec: ToolSpec, command: str, **extra: Any) -> str:
    return await spec.handler({"command": command, **extra}, CTX)


def running(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (this container's init never reaps)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def wait_for_file(path: Path) -> int:
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def test_spec(spec: ToolSpec) -> None:
    assert (spec.name, spec.safety, spec.effect) == ("run_bash", Safety.DANGEROUS, Effect.MUTATE)
    assert spec.requires_approval is True
    assert spec.resource_keys == ("fs:workspace",)
    assert spec.input_schema["properties"]["timeout_s"]["maximum"] == 10
    assert spec.timeout_s > 10 + KILL_GRACE_S


async def test_output_and_exit_code(spec: ToolSpec, ws: Path) -> None:
    out = await run(spec, "echo out; echo err >&2; pwd; exit 3")
    assert out == f"exit code: 3\n--- stdout ---\nout\n{ws.resolve()}\n\n--- stderr ---\nerr\n"
    assert ws.is_dir()


async def test_the_daemon_environment_does_not_leak(
    spec: ToolSpec, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GEODEBOT_SECRET_TEST", "sk-do-not-leak")
    out = await run(spec, "env")
    assert "GEODEBOT_SECRET_TEST" not in out
    assert "sk-do-not-leak" not in out
    variables = {
        line.split("=", 1)[0]: line.split("=", 1)[1]
        for line in out.split("--- stdout ---\n")[1].split("\n--- stderr")[0].splitlines()
    }
    assert variables["HOME"] == str(ws.resolve())
    assert variables["LANG"] == "C.UTF-8"
    assert set(variables) <= {"HOME", "LANG", "PATH", "PWD", "SHLVL", "_", "OLDPWD"}


async def test_stdin_is_closed(spec: ToolSpec) -> None:
    out = await run(spec, "cat; echo done", timeout_s=5)
    assert out.startswith("exit code: 0\n--- stdout ---\ndone\n")


async def test_output_is_capped(spec: ToolSpec) -> None:
    out = await run(spec, "head -c 200000 /dev/zero | tr '\\0' a; head -c 70000 /dev/zero >&2")
    stdout = out.split("--- stdout ---\n")[1].split("\n--- stderr ---\n")[0]
    assert (
        stdout
        == "a" * MAX_STREAM_BYTES
        + f"\n[truncated: {200000 - MAX_STREAM_BYTES} more bytes not shown]"
    )
    assert out.endswith(f"[truncated: {70000 - MAX_STREAM_BYTES} more bytes not shown]")


async def test_timeout_kills_the_whole_group(spec: ToolSpec, ws: Path) -> None:
    started = time.monotonic()
    with pytest.raises(ToolError) as info:
        await run(spec, SPAWNER, timeout_s=0.5)
    assert str(info.value).startswith("command timed out after 0.5 s; its process group was killed")
    assert time.monotonic() - started < 0.5 + KILL_GRACE_S + 1
    shell = int((ws / "shell.pid").read_text())
    grandchild = int((ws / "grandchild.pid").read_text())
    assert not running(grandchild)
    with pytest.raises(ProcessLookupError):
        os.kill(shell, 0)  # reaped, not a zombie


async def test_cancelling_the_handler_kills_the_group(spec: ToolSpec, ws: Path) -> None:
    task = asyncio.create_task(run(spec, SPAWNER))
    grandchild = await wait_for_file(ws / "grandchild.pid")
    shell = await wait_for_file(ws / "shell.pid")
    assert running(grandchild)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not running(grandchild)
    with pytest.raises(ProcessLookupError):
        os.kill(shell, 0)


async def test_an_executor_deadline_kills_the_group(spec: ToolSpec, ws: Path) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5):
            await run(spec, SPAWNER)
    assert not running(int((ws / "grandchild.pid").read_text()))


async def test_background_children_do_not_outlive_a_finished_command(
    spec: ToolSpec, ws: Path
) -> None:
    # The subshell exits at once, so the sleep is orphaned but still in the group.
    out = await run(spec, "( sleep 300 > /dev/null 2>&1 & echo $! > bg.pid ); echo started")
    assert out.startswith("exit code: 0\n--- stdout ---\nstarted\n")
    assert not running(int((ws / "bg.pid").read_text()))


async def test_signal_death_is_reported(spec: ToolSpec) -> None:
    out = await run(spec, "kill -KILL $$")
    assert out.startswith("killed by signal 9\n")


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"command": ""}, "non-empty string"),
        ({"command": 5}, "non-empty string"),
        ({"command": "echo a\x00b"}, "no NUL byte"),
        ({"command": "true", "timeout_s": 11}, "at most 10"),
        ({"command": "true", "timeout_s": 0}, "more than 0"),
        ({"command": "true", "timeout_s": True}, "must be a number"),
    ],
)
async def test_arguments_are_checked(
    spec: ToolSpec, ws: Path, arguments: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ToolError, match=expected):
        await spec.handler(arguments, CTX)
    assert not ws.exists()
