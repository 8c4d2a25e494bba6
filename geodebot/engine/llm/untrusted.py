"""What a model's response may hold, made safe to keep and to send again.

A response is stored in the session's history and sent back with every later request, so
anything in it that cannot be encoded again bricks the session: each request fails before
it is sent, until ``/reset``. Python's JSON parser accepts what JSON cannot carry (``NaN``,
``Infinity``, escapes of lone surrogates) and stops with ``RecursionError`` on deep nesting.
So, for both providers:

* a body nested deeper than the parser can follow is parsed with the too-deep values
  replaced by a marker (:func:`loads_response`);
* a tool call whose input is not JSON at all keeps its id and name but no input, and says
  why (:func:`tool_use_json`);
* a tool call whose input cannot be represented (a non-finite number, a lone surrogate, the
  marker, nesting deeper than :data:`MAX_ARGUMENT_DEPTH`) keeps its id and name but no
  input, and carries the reason as ``arguments_error``: the tool layer answers it with an
  error result, so the model is told (:func:`tool_use`);
* text has lone surrogates replaced by U+FFFD (:func:`clean_text`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from geodebot.engine.llm.types import ToolUseBlock

# Deeper than any real tool input; what is deeper is refused, not stored.
MAX_ARGUMENT_DEPTH = 64
# Where loads_response cuts a body the parser could not follow; the cut values become the
# marker, so the call holding them is refused by tool_use.
MAX_BODY_DEPTH = 100
_MARKER = "\x00geodebot:nested too deeply\x00"
_MARKER_JSON = json.dumps(_MARKER)
# A JSON string, an unterminated one (a lone quote: the body is malformed, stop), or a bracket.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|"|[\[\]{}]', re.DOTALL)


def loads_response(text: str | bytes) -> Any:
    """``json.loads``, except that a body nested too deeply for the parser is parsed with
    each value below :data:`MAX_BODY_DEPTH` levels replaced by a marker string."""
    try:
        return json.loads(text)
    except RecursionError:
        pass
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    try:
        return json.loads(_capped(text, MAX_BODY_DEPTH))
    except RecursionError:
        raise ValueError("the body is nested too deeply to parse") from None


def _capped(text: str, cap: int) -> str:
    out: list[str] = []
    depth = 0
    kept_to = 0  # text[kept_to:] is not yet in out
    cut_at: int | None = None  # where the value being cut began
    pos = 0
    while (match := _TOKEN.search(text, pos)) is not None:
        token, pos = match.group(), match.end()
        if token == '"':
            break
        if token[0] == '"':
            continue
        if token in "[{":
            depth += 1
            if depth == cap + 1 and cut_at is None:
                cut_at = match.start()
        else:
            if depth == cap + 1 and cut_at is not None:
                out.append(text[kept_to:cut_at])
                out.append(_MARKER_JSON)
                kept_to, cut_at = pos, None
            depth -= 1
    out.append(text[kept_to:])
    return "".join(out)


def clean_text(text: str) -> str:
    """``text`` with lone surrogates (which UTF-8 cannot encode) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # Valid surrogate pairs become their character; lone ones become U+FFFD.
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def tool_use(call_id: str, name: str, arguments: object) -> ToolUseBlock:
    """The block for one proposed call; an input that cannot be kept is refused, not kept."""
    call_id, name = clean_text(call_id), clean_text(name)
    if not isinstance(arguments, Mapping):
        kind = "null" if arguments is None else type(arguments).__name__
        return ToolUseBlock(call_id, name, {}, f"tool input is a {kind}, not an object")
    problem = unrepresentable(arguments)
    if problem is not None:
        return ToolUseBlock(call_id, name, {}, f"tool input cannot be used: {problem}")
    return ToolUseBlock(call_id, name, dict(arguments))


def tool_use_json(call_id: str, name: str, raw: str) -> ToolUseBlock:
    """The block for one proposed call whose input came as JSON text, which may not parse:
    OpenAI's ``arguments`` string, or an Anthropic input streamed in fragments."""
    try:
        arguments = loads_response(raw) if raw.strip() else {}
    except ValueError as exc:
        problem = f"arguments are not valid JSON: {exc}"
        return ToolUseBlock(clean_text(call_id), clean_text(name), {}, problem)
    return tool_use(call_id, name, arguments)


def unrepresentable(value: Mapping[str, Any]) -> str | None:
    """Why ``value`` cannot be stored and sent as JSON again, or None if it can."""
    if _too_deep(value, MAX_ARGUMENT_DEPTH):
        return f"it is nested deeper than {MAX_ARGUMENT_DEPTH} levels"
    try:
        encoded = json.dumps(value, allow_nan=False, ensure_ascii=False)
        encoded.encode("utf-8")
    except UnicodeEncodeError:  # before ValueError, its base class
        return "it holds a lone surrogate escape, which UTF-8 cannot carry"
    except ValueError:
        # json's own words ("Out of range float values are not JSON compliant") say less.
        return "it holds NaN or Infinity, which JSON cannot carry"
    except (TypeError, RecursionError) as exc:
        return f"it is not JSON ({type(exc).__name__})"
    if _MARKER in encoded:
        return "it is nested too deeply"
    return None


def _too_deep(value: object, limit: int) -> bool:
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
