"""The geodebot command as a user runs it: a subprocess against the fake model server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import sys
from pathlib import Path

import pytest

from tests.support.cli import geodebot, model_table, write_config
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.fakes.llm_server import FakeLLMServer, Reply

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("provider", ["anthropic", "openai-compatible"])
async def test_run_prints_the_scripted_answer(
    tmp_path: Path, llm_server: FakeLLMServer, provider: str
) -> None:
    llm_server.script(Reply("The scripted answer."))
    config = write_config(tmp_path, model_table(llm_server, provider))
    code, out, err = await geodebot("run", "--config", str(config), "What is it?")
    assert (code, out) == (0, "The scripted answer.\n"), err
    assert llm_server.requests[0].json["model"] == "cli-model-7"
    assert TEST_KEY not in out + err


async def test_run_fails_with_exit_1_on_a_model_error(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    config = write_config(tmp_path, model_table(llm_server, "anthropic"))
    env = {k: v for k, v in os.environ.items() if k != TEST_KEY_ENV}
    code, out, err = await geodebot("run", "--config", str(config), "hi", env=env)
    assert code == 1
    assert out == ""
    assert TEST_KEY_ENV in err
    assert "Traceback" not in err


async def test_broken_config_gives_one_line_per_problem_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "broken.toml"
    config.write_text('[model]\nprovider = "gemini"\nmax_retries = "many"\n[extra]\nx = 1\n')
    code, _out, err = await geodebot("run", "--config", str(config), "hi")
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 3, err
    assert any(
        "model.provider: must be one of anthropic, openai, openai-compatible" in ln for ln in lines
    )
    assert any("model.max_retries" in ln for ln in lines)
    assert any("extra: unknown key" in ln for ln in lines)


async def test_missing_config_file_is_exit_2(tmp_path: Path) -> None:
    code, _, err = await geodebot("sessions", "list", "--config", str(tmp_path / "none.toml"))
    assert code == 2
    assert "file not found" in err
    assert "Traceback" not in err


async def test_sessions_and_timeline_read_the_store(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("stored"))
    config = str(write_config(tmp_path, model_table(llm_server, "anthropic")))
    assert (await geodebot("run", "--config", config, "--session", "ops", "hi"))[0] == 0
    code, out, _ = await geodebot("sessions", "list", "--config", config)
    assert code == 0
    assert "ops" in out
    assert "headless" in out
    code, out, _ = await geodebot("sessions", "show", "ops", "--config", config)
    shown = json.loads(out)
    assert shown["context_messages"] == 2
    assert shown["generation"] == 1
    code, out, _ = await geodebot("timeline", "ops", "--json", "--config", config)
    events = [json.loads(line) for line in out.splitlines()]
    assert next(e["kind"] for e in events) == "turn_started"
    assert events[-1]["kind"] == "turn_finished"
    assert events[-1]["data"]["outcome"] == "completed"
    code, out, _ = await geodebot("sessions", "reset", "ops", "--config", config)
    assert code == 0
    assert "generation 2" in out
    code, out, _ = await geodebot("sessions", "show", "ops", "--config", config)
    assert json.loads(out)["context_messages"] == 0
    code, _, err = await geodebot("sessions", "show", "nope", "--config", config)
    assert code == 1
    assert "no session" in err


async def test_serve_and_chat_without_an_api_key(tmp_path: Path) -> None:
    """A fresh machine: no key anywhere. The daemon starts; a turn names the variable."""
    config = tmp_path / "config.toml"
    example = (ROOT / "config.example.toml").read_text()
    config.write_text(example.replace('state_dir = "./var"', f'state_dir = "{tmp_path / "var"}"'))
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    daemon = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "geodebot",
        "serve",
        "--config",
        str(config),
        cwd=ROOT,
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    socket_path = tmp_path / "var" / "geodebot.sock"
    try:
        for _ in range(200):
            if socket_path.exists():
                break
            assert daemon.returncode is None
            await asyncio.sleep(0.05)
        assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
        code, out, err = await geodebot(
            "chat", "--config", str(config), env=env, stdin=b"hello there\n"
        )
        assert "ANTHROPIC_API_KEY" in out, (out, err)
        assert code == 1  # the turn did not complete
    finally:
        daemon.send_signal(signal.SIGTERM)
        _, daemon_err = await asyncio.wait_for(daemon.communicate(), timeout=30)
    assert daemon.returncode == 0, daemon_err.decode()
    assert "Traceback" not in daemon_err.decode()
    assert not socket_path.exists()


async def test_chat_without_a_daemon_says_so(tmp_path: Path) -> None:
    config = write_config(tmp_path, "")
    code, _, err = await geodebot("chat", "--config", str(config), stdin=b"hi\n")
    assert code == 1
    assert "no geodebot daemon" in err


async def test_unusable_state_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "var"
    blocker.write_text("a file where the state directory should be")
    config = write_config(tmp_path, "")
    code, _, err = await geodebot("run", "--config", str(config), "hi")
    assert code == 1
    assert str(blocker) in err
    assert "Traceback" not in err


async def test_deny_listed_tool_in_a_tool_list_is_a_config_error(tmp_path: Path) -> None:
    config = write_config(tmp_path, '[tools]\nheadless_tools = ["get_time", "run_bash", "nope"]\n')
    code, _, err = await geodebot("run", "--config", str(config), "hi")
    assert code == 2
    assert "tools.headless_tools: run_bash: never available in headless mode" in err
    assert "tools.headless_tools: nope: no such tool" in err
    assert "Traceback" not in err


async def test_operator_switch_round_trip(tmp_path: Path) -> None:
    config = str(write_config(tmp_path, ""))
    code, out, _ = await geodebot("operator", "computer-use", "status", "--config", config)
    assert code == 0
    assert "computer use: off" in out
    code, out, _ = await geodebot(
        "operator", "computer-use", "on", "--for", "2h", "--reason", "demo", "--config", config
    )
    assert code == 0
    assert "computer use: on until" in out
    assert "(demo)" in out
    code, out, _ = await geodebot("operator", "computer-use", "off", "--config", config)
    assert "computer use: off" in out
    code, _, err = await geodebot(
        "operator", "computer-use", "on", "--for", "soon", "--config", config
    )
    assert code == 2
    assert "not a duration" in err


async def test_receipts_list_and_resolve(tmp_path: Path) -> None:
    from geodebot.store.records import EffectReceipt
    from geodebot.store.sqlite import SQLiteStore

    config = str(write_config(tmp_path, ""))
    async with SQLiteStore(tmp_path / "var" / "geodebot.db") as store:
        await store.ensure_session("ops", "daemon")
        receipt = EffectReceipt(
            id="r-1",
            key="k-1",
            session_id="ops",
            turn_id="t-1",
            call_id="c-1",
            tool="write_file",
            effect="mutate",
            arguments_sha256="0" * 64,
            status="admitted",
            admitted_at=1.0,
        )
        await store.admit_receipt(receipt)
        await store.mark_admitted_uncertain("restart")
    code, out, _ = await geodebot("receipts", "list", "--uncertain", "--config", config)
    assert code == 0
    assert "r-1" in out
    assert "write_file" in out
    code, out, _ = await geodebot("receipts", "resolve", "r-1", "--as", "done", "--config", config)
    assert code == 0
    assert "resolved as done" in out
    code, out, _ = await geodebot("receipts", "list", "--uncertain", "--config", config)
    assert "r-1" not in out
    code, _, err = await geodebot("receipts", "resolve", "r-1", "--as", "done", "--config", config)
    assert code == 1
    assert "Traceback" not in err


async def test_config_trust_pins_the_file(tmp_path: Path) -> None:
    config = str(write_config(tmp_path, ""))
    project = tmp_path / "mcp.toml"
    project.write_text('[[servers]]\nname = "p"\ncommand = ["true"]\n')
    code, out, _ = await geodebot("config", "trust", str(project), "--config", config)
    assert code == 0
    assert "trusted" in out
    assert (tmp_path / "var" / "trust.json").exists()
    project.write_text("[[servers]]\nbogus = 1\n")
    code, _, err = await geodebot("config", "trust", str(project), "--config", config)
    assert code == 2
    assert "Traceback" not in err


async def test_chat_asks_at_the_terminal_before_a_write(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    from tests.support.fakes.llm_server import Call

    body = model_table(llm_server, "anthropic") + (
        f'[tools]\nworkspace = "{tmp_path / "ws"}"\nipc_tools = ["write_file"]\n'
    )
    config = str(write_config(tmp_path, body))
    llm_server.script(
        Reply(tool_calls=[Call("write_file", {"path": "note.txt", "content": "hi"})]),
        Reply("Written."),
        Reply(tool_calls=[Call("write_file", {"path": "other.txt", "content": "no"})]),
        Reply("Not written."),
    )
    daemon = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "geodebot",
        "serve",
        "--config",
        config,
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )
    socket_path = tmp_path / "var" / "geodebot.sock"
    try:
        for _ in range(200):
            if socket_path.exists():
                break
            await asyncio.sleep(0.05)
        code, out, err = await geodebot(
            "chat", "--config", config, stdin=b"write note\ny\nwrite other\nn\n"
        )
    finally:
        daemon.send_signal(signal.SIGTERM)
        await asyncio.wait_for(daemon.communicate(), timeout=30)
    assert code == 0, err
    assert out.count("geodebot asks to run write_file") == 2
    assert "Written." in out
    assert "Not written." in out
    assert (tmp_path / "ws" / "note.txt").read_text() == "hi"
    assert not (tmp_path / "ws" / "other.txt").exists()
