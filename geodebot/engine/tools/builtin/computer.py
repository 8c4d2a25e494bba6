"""The ``computer`` tool: screenshot, click, double-click, type, key, scroll and cursor position,
carried out by ``geodebot desktop-agent`` beside an X display and reached over its unix socket.

The daemon itself never touches a display (its service keeps its hardening); without a
configured agent socket every call is refused. Whether a call may run at all is the authority
pipeline's business: DAEMON needs the operator switch, the binding listing ``computer`` and
pre-approval.

The action is a nested object discriminated by ``type`` because providers reject oneOf at
the top level of a tool's input schema.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from geodebot.engine.llm.types import ImageData
from geodebot.engine.tools.spec import (
    Effect,
    Handler,
    Safety,
    ToolCallContext,
    ToolError,
    ToolOutcomeUnknown,
    ToolOutput,
    ToolSpec,
)

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
                _action("cursor_position", "Where the pointer is."),
                _action("click", "Click at pixel (x, y).", x=_COORDINATE, y=_COORDINATE),
                _action(
                    "double_click", "Double-click at pixel (x, y).", x=_COORDINATE, y=_COORDINATE
                ),
                _action(
                    "right_click", "Right-click at pixel (x, y).", x=_COORDINATE, y=_COORDINATE
                ),
                _action(
                    "scroll",
                    "Scroll the wheel at pixel (x, y).",
                    x=_COORDINATE,
                    y=_COORDINATE,
                    direction={"enum": ["up", "down", "left", "right"]},
                    amount={"type": "integer", "minimum": 1, "maximum": 50},
                ),
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


_TIMEOUT_S = 20.0
_MAX_ANSWER_BYTES = 16 * 1024 * 1024


def _request(action: Mapping[str, Any]) -> dict[str, Any]:
    """The agent's request for one validated action."""
    kind = action["type"]
    if kind in ("click", "double_click", "right_click"):
        return {
            "op": "click",
            "x": action["x"],
            "y": action["y"],
            "button": "right" if kind == "right_click" else "left",
            "double": kind == "double_click",
        }
    if kind == "scroll":
        return {
            "op": "scroll",
            "x": action["x"],
            "y": action["y"],
            "direction": action["direction"],
            "amount": action["amount"],
        }
    return {"op": kind, **{k: v for k, v in action.items() if k != "type"}}


def _describe(action: Mapping[str, Any], answer: Mapping[str, Any]) -> str:
    kind = action["type"]
    if kind == "cursor_position":
        return f"the pointer is at ({answer['x']}, {answer['y']})"
    if kind in ("click", "double_click", "right_click", "scroll"):
        return f"{kind.replace('_', ' ')} at ({action['x']}, {action['y']}) done"
    if kind == "type":
        return f"typed {len(action['text'])} characters"
    return f"pressed {action['keys']}"


def computer_handler(socket: Path | None) -> Handler:
    async def handler(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str | ToolOutput:
        if socket is None:
            raise ToolError("computer use has no backend on this host (tools.computer_socket)")
        action = arguments["action"]
        try:
            reader, writer = await asyncio.open_unix_connection(
                str(socket), limit=_MAX_ANSWER_BYTES
            )
        except OSError as exc:
            # Nothing was sent: nothing happened on the display.
            raise ToolError(f"the desktop agent is not reachable at {socket}: {exc}") from None
        try:
            async with asyncio.timeout(_TIMEOUT_S):
                writer.write(json.dumps(_request(action)).encode() + b"\n")
                await writer.drain()
                line = await reader.readline()
        except (OSError, TimeoutError, ValueError) as exc:
            # Sent but unanswered: the click or keystroke may have happened.
            raise ToolOutcomeUnknown(f"the desktop agent did not answer: {exc!r}") from None
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        try:
            answer = json.loads(line)
        except ValueError:
            raise ToolOutcomeUnknown("the desktop agent's answer was unreadable") from None
        if not answer.get("ok"):
            raise ToolError(f"the desktop refused: {answer.get('error', 'no reason given')}")
        if action["type"] == "screenshot":
            image = ImageData("image/png", str(answer["png"]))
            return ToolOutput(f"screenshot, {answer['width']}x{answer['height']}", (image,))
        return _describe(action, answer)

    return handler


def computer_tool(socket: Path | None = None) -> ToolSpec:
    return ToolSpec(
        name="computer",
        description=(
            "Control the desktop display: take a screenshot (returned as an image), click, "
            "double-click, right-click, type text, press keys, scroll, or read the pointer "
            "position. Coordinates are screen pixels; take a screenshot first."
        ),
        input_schema=INPUT_SCHEMA,
        safety=Safety.DANGEROUS,
        effect=Effect.MUTATE,
        handler=computer_handler(socket),
        resource_keys=("display",),
        requires_approval=True,
        timeout_s=_TIMEOUT_S + 5,
        repeatable=True,
    )
