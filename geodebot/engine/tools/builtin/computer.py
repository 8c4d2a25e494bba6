"""The ``computer`` tool's declaration. No backend exists yet, so every call is refused.

The action is a nested object discriminated by ``type`` because providers reject oneOf at
the top level of a tool's input schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from geodebot.engine.tools.spec import Effect, Safety, ToolCallContext, ToolError, ToolSpec

MAX_COORDINATE = 100_000
MAX_TEXT_CHARS = 4000
MAX_KEYS_CHARS = 100


def _action(kind: str, description: str, **fields: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "description": description,
        "properties": {"type": {"const": kind}, **fields},
        "required": ["type", *fields],
        "additionalProperties": False,
    }


_COORDINATE = {"type": "integer", "minimum": 0, "maximum": MAX_COORDINATE}

INPUT_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {
        "action": {
            "oneOf": [
                _action("screenshot", "Capture the screen."),
                _action("click", "Click at pixel (x, y).", x=_COORDINATE, y=_COORDINATE),
                _action(
                    "type",
                    "Type text at the focus.",
                    text={"type": "string", "minLength": 1, "maxLength": MAX_TEXT_CHARS},
                ),
                _action(
                    "key",
                    "Press a key or chord, such as 'Return' or 'ctrl+c'.",
                    keys={"type": "string", "minLength": 1, "maxLength": MAX_KEYS_CHARS},
                ),
            ]
        }
    },
    "required": ["action"],
    "additionalProperties": False,
}


async def _refuse(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
    raise ToolError("computer use has no backend on this host")


def computer_tool() -> ToolSpec:
    return ToolSpec(
        name="computer",
        description=(
            "Control the host's display: take a screenshot, click, type text or press keys."
        ),
        input_schema=INPUT_SCHEMA,
        safety=Safety.DANGEROUS,
        effect=Effect.MUTATE,
        handler=_refuse,
        resource_keys=("display",),
        requires_approval=True,
    )
