"""The built-in tool set as a whole, and the computer tool's declaration."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from geodebot.engine.modes import Mode
from geodebot.engine.tools import (
    DataClass,
    Effect,
    Safety,
    ToolCallContext,
    ToolError,
    ToolRegistry,
)
from geodebot.engine.tools.builtin import BuiltinSettings, builtin_tools
from geodebot.engine.tools.builtin.computer import computer_tool
from geodebot.engine.tools.registry import GET_TIME

CTX = ToolCallContext(session_id="s", turn_id="t", mode=Mode.IPC)

EXPECTED = {
    # name: (safety, effect, resource keys, needs approval)
    "get_time": (Safety.READ, Effect.NONE, (), False),
    "read_file": (Safety.READ, Effect.NONE, ("fs:workspace",), False),
    "list_dir": (Safety.READ, Effect.NONE, ("fs:workspace",), False),
    "search_files": (Safety.READ, Effect.NONE, ("fs:workspace",), False),
    "write_file": (Safety.WRITE, Effect.MUTATE, ("fs:workspace",), True),
    "edit_file": (Safety.WRITE, Effect.MUTATE, ("fs:workspace",), True),
    "http_get": (Safety.READ, Effect.NONE, ("net",), False),
    "run_bash": (Safety.DANGEROUS, Effect.MUTATE, ("fs:workspace",), True),
    "computer": (Safety.DANGEROUS, Effect.MUTATE, ("display",), True),
}


def test_settings_defaults_and_immutability(tmp_path: Path) -> None:
    settings = BuiltinSettings(workspace=tmp_path)
    assert settings.http_allow_hosts == ()
    assert settings.http_allow_private is False
    assert (settings.http_max_bytes, settings.http_timeout_s) == (1_000_000, 20.0)
    assert settings.bash_timeout_s == 60.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.bash_timeout_s = 1  # type: ignore[misc]  # frozen on purpose


def test_every_builtin_is_declared_as_expected(tmp_path: Path) -> None:
    specs = builtin_tools(BuiltinSettings(workspace=tmp_path / "ws"))
    assert GET_TIME in specs
    declared = {s.name: (s.safety, s.effect, s.resource_keys, s.needs_approval) for s in specs}
    assert declared == EXPECTED
    # Building the tools must not touch the disk: the workspace appears on first use.
    assert not (tmp_path / "ws").exists()


def test_the_registry_accepts_every_schema(tmp_path: Path) -> None:
    registry = ToolRegistry(builtin_tools(BuiltinSettings(workspace=tmp_path)))
    assert registry.names() == sorted(EXPECTED)


@pytest.mark.parametrize(
    ("tool", "arguments", "valid"),
    [
        ("read_file", {"path": "a.txt", "offset": 2, "limit": 10}, True),
        ("read_file", {"path": "a.txt", "offset": 0}, False),
        ("read_file", {"path": ""}, False),
        ("list_dir", {}, True),
        ("search_files", {"pattern": "x", "regex": True, "glob": "*.py"}, True),
        ("search_files", {"pattern": ""}, False),
        ("write_file", {"path": "a.txt", "content": ""}, True),
        ("write_file", {"path": "a.txt"}, False),
        ("edit_file", {"path": "a", "old_text": "x", "new_text": ""}, True),
        ("edit_file", {"path": "a", "old_text": "", "new_text": "y"}, False),
        ("http_get", {"url": "https://example.invalid/"}, True),
        ("http_get", {"url": "https://example.invalid/", "method": "POST"}, False),
        ("run_bash", {"command": "ls", "timeout_s": 60}, True),
        ("run_bash", {"command": "ls", "timeout_s": 61}, False),
        ("run_bash", {"command": "ls", "env": {"A": "1"}}, False),
    ],
)
def test_schemas_accept_and_reject_what_the_handlers_expect(
    tmp_path: Path, tool: str, arguments: dict[str, Any], valid: bool
) -> None:
    specs = {s.name: s for s in builtin_tools(BuiltinSettings(workspace=tmp_path))}
    assert (specs[tool].arguments_schema.problems(arguments) == []) is valid


VALID_ACTIONS: list[dict[str, Any]] = [
    {"type": "screenshot"},
    {"type": "click", "x": 10, "y": 20},
    {"type": "double_click", "x": 10, "y": 20},
    {"type": "right_click", "x": 10, "y": 20},
    {"type": "scroll", "x": 1, "y": 2, "direction": "down", "amount": 3},
    {"type": "cursor_position"},
    {"type": "type", "text": "hello"},
    {"type": "key", "keys": "ctrl+c"},
]
INVALID_ACTIONS: list[Any] = [
    {"type": "click", "x": 10},
    {"type": "click", "x": -1, "y": 0},
    {"type": "click", "x": 1.5, "y": 0},
    {"type": "type"},
    {"type": "type", "text": ""},
    {"type": "key", "keys": "a", "extra": 1},
    {"type": "scroll"},
    {"type": "scroll", "x": 1, "y": 2, "direction": "diagonal", "amount": 3},
    {"type": "scroll", "x": 1, "y": 2, "direction": "up", "amount": 51},
    "screenshot",
]


@pytest.mark.parametrize("action", VALID_ACTIONS)
def test_computer_schema_accepts_each_action(action: dict[str, Any]) -> None:
    assert computer_tool().arguments_schema.problems({"action": action}) == []


@pytest.mark.parametrize("action", INVALID_ACTIONS)
def test_computer_schema_rejects_malformed_actions(action: Any) -> None:
    assert computer_tool().arguments_schema.problems({"action": action}) != []


def test_computer_schema_has_no_top_level_combinator() -> None:
    schema = computer_tool().input_schema
    assert schema["type"] == "object"
    assert not {"oneOf", "anyOf", "allOf"} & set(schema)


async def test_without_a_desktop_agent_the_computer_tool_refuses_every_call() -> None:
    spec = computer_tool()
    assert spec.data_class is DataClass.INTERNAL
    assert spec.repeatable  # two screenshots in a turn are two screenshots
    for action in VALID_ACTIONS:
        with pytest.raises(ToolError, match="computer use has no backend on this host"):
            await spec.handler({"action": action}, CTX)
