"""Tool input schemas, compiled once and checked in linear time.

A schema comes from our own tools or from an MCP server nobody on the team wrote, and the
arguments checked against it come from the model: both are untrusted. Python's ``re`` (which
the ``jsonschema`` package uses for ``pattern`` and ``patternProperties``) backtracks, so one
catastrophic pattern on a 40-character string holds the GIL, and with it the event loop, for
minutes. ``jsonschema_rs`` with :class:`RegexOptions` matches with the Rust ``regex`` crate,
whose matching time is linear in the input, and it refuses at compile time what it cannot
check: an unknown type, a pattern that is not a regex it accepts (backreferences and
lookaround included), a ``$ref`` that points nowhere.

The extension is imported when the first schema is compiled, not with this module: an idle
daemon does not carry it (several MB), and a tool's schema is compiled at its first call
(an MCP server's when its tools are listed, so a bad one is found then).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

# Deeper than any real tool schema; a schema nested further is refused, not recursed into.
MAX_SCHEMA_DEPTH = 64
# Bounds the compiled form of one pattern, so a schema cannot make us allocate without limit.
_REGEX_SIZE_LIMIT = 1 << 20


class SchemaError(ValueError):
    """The schema itself is unusable; the tool declaring it cannot be offered."""


def _plain(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` made of dicts, lists and JSON scalars only."""
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaError(f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise SchemaError(f"key {key!r} is not a string")
            out[key] = _plain(item, depth + 1)
        return out
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_plain(item, depth + 1) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise SchemaError(f"{value!r} is not a JSON number")
    if value is None or isinstance(value, str | int | float):
        return value
    raise SchemaError(f"a {type(value).__name__} is not JSON")


class ArgumentSchema:
    """One tool's input schema, compiled; ``problems(arguments)`` lists what is wrong."""

    __slots__ = ("_validator",)

    def __init__(self, schema: Mapping[str, Any]) -> None:
        plain = _plain(schema)  # bounded by MAX_SCHEMA_DEPTH, so it cannot recurse too far
        if not isinstance(plain, dict):
            raise SchemaError("a tool's input schema must be an object")
        import jsonschema_rs  # see the module docstring

        regex = jsonschema_rs.RegexOptions(
            size_limit=_REGEX_SIZE_LIMIT, dfa_size_limit=_REGEX_SIZE_LIMIT
        )
        try:
            # Without "$schema" this is draft 2020-12, what the model APIs expect.
            self._validator = jsonschema_rs.validator_for(
                plain, validate_formats=False, pattern_options=regex
            )
        except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
            raise SchemaError(_first_line(str(exc))) from None

    def problems(self, arguments: Mapping[str, Any], limit: int = 5) -> list[str]:
        """Up to ``limit`` problems, each ``where: what``; empty when the arguments fit."""
        found: list[str] = []
        try:
            for error in self._validator.iter_errors(dict(arguments)):
                where = "/".join(str(p) for p in error.instance_path) or "arguments"
                found.append(f"{where[:80]}: {_first_line(error.message)[:200]}")
                if len(found) >= limit:
                    break
        except (RecursionError, ValueError) as exc:
            found.append(f"arguments cannot be checked: {_first_line(str(exc))[:200]}")
        return found


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0]
