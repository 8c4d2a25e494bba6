"""``geodebot run`` on the OpenAI-compatible path against a hostile model: a tool input that
cannot be encoded again is refused as that call's error, and the session goes on."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import geodebot, model_table, write_config
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply


def tool_results(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in body["messages"] if m["role"] == "tool"]


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ('{"timezone": NaN}', "NaN"),
        ('{"timezone": Infinity}', "NaN or Infinity"),
        ('{"a":' * 3000 + "1" + "}" * 3000, "nested"),
        ('{"timezone": "\\ud800"}', "surrogate"),
    ],
    ids=["nan", "infinity", "deep", "lone-surrogate"],
)
async def test_an_unrepresentable_tool_input_never_bricks_the_session(
    tmp_path: Path, llm_server: FakeLLMServer, arguments: str, said: str
) -> None:
    config = write_config(tmp_path, model_table(llm_server, "openai-compatible"))
    env = {**os.environ, TEST_KEY_ENV: TEST_KEY}
    llm_server.script(
        Reply(tool_calls=[Call("get_time", arguments, id="call_bad")]),
        Reply("that call was refused"),
        Reply("still answering"),
    )
    run = ("run", "--config", str(config), "--session", "s1")
    code, out, err = await geodebot(*run, "what time is it?", env=env)
    assert (code, out.strip()) == (0, "that call was refused"), err
    [result] = tool_results(llm_server.requests[1].json)
    assert result["tool_call_id"] == "call_bad"
    assert "invalid arguments" in result["content"]
    assert said in result["content"]
    # The next turn of the same session sends the whole history, and gets its answer.
    code, out, err = await geodebot(*run, "and now?", env=env)
    assert (code, out.strip()) == (0, "still answering"), err
    assert "Traceback" not in err
    history = llm_server.requests[2].json["messages"]
    [call] = [m for m in history if m.get("tool_calls")]
    assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {}
