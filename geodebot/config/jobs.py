"""The ``[[jobs]]`` table of the configuration: pure data, validated by pydantic.

Its own module so that schema.py stays one screenful per concern; schema.py re-exports it.
"""

from __future__ import annotations

import re
from datetime import datetime
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


def _is_number(annotation: Any) -> bool:
    """Whether a field's type is int or float (also inside Annotated or Optional)."""
    if annotation in (int, float):
        return True
    if get_origin(annotation) is Annotated:
        return _is_number(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):
        return any(_is_number(arm) for arm in get_args(annotation) if arm is not type(None))
    return False


class ConfigModel(BaseModel):
    """The base of every table of the configuration (schema.py's and this module's):
    unknown keys are errors, values are frozen, and a number is never a boolean, which
    pydantic would read as 1 or 0 (``timeout_s = true`` would quietly mean one second)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _is_number(field.annotation):
            raise ValueError(f"must be a number, not {str(value).lower()}")
        return value


def check_timezone(value: str) -> str:
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown timezone {value!r} (an IANA name like Europe/Berlin)") from None
    return value


EVERY_PATTERN = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class JobConfig(ConfigModel):
    """A scheduled job; cron strings are checked where the scheduler builds its triggers."""

    id: Annotated[str, Field(pattern=JOB_ID_PATTERN)]
    # Exactly one of: cron (5 fields, or 6 with seconds first), every ("90s", "15m", "2h"),
    # at (ISO 8601).
    cron: str | None = None
    every: str | None = None
    at: str | None = None
    # None: [daemon] timezone.
    timezone: str | None = None
    prompt: Annotated[str, Field(min_length=1)]
    # The session id of a binding: the result is posted in that binding's chat.
    deliver_to: Annotated[str, Field(min_length=1)]
    # The key ("platform:channel") of the binding to post in: needed when several bindings
    # share deliver_to's session, since a session does not name one chat.
    deliver_binding: Annotated[str, Field(min_length=1, max_length=300)] | None = None
    # None: "job:<id>". May name a binding's session to share its context.
    session: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    tools: tuple[str, ...] = ()
    time_budget_s: Annotated[float, Field(gt=0, le=86_400)] | None = None
    # Tokens one run may spend (all its model calls); None: no limit of its own.
    max_tokens_per_run: Annotated[int, Field(ge=1)] | None = None
    catch_up: Literal["latest", "skip", "all"] = "latest"
    notify_on_failure: bool = True

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, value: str | None) -> str | None:
        return None if value is None else check_timezone(value)

    @field_validator("every")
    @classmethod
    def _every(cls, value: str | None) -> str | None:
        if value is not None and EVERY_PATTERN.match(value) is None:
            raise ValueError(f"{value!r} is not a duration like 90s, 15m, 2h or 1d")
        return value

    @field_validator("at")
    @classmethod
    def _at(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                datetime.fromisoformat(value)
            except ValueError:
                raise ValueError(f"{value!r} is not an ISO 8601 date and time") from None
        return value

    @model_validator(mode="after")
    def _one_schedule(self) -> JobConfig:
        given = [k for k in ("cron", "every", "at") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of cron, every or at")
        return self

    @property
    def session_id(self) -> str:
        # A job of the config file keeps "job:<id>" for its whole life in the file, across
        # restarts and edits: its context is the operator's to keep, and a stamped session
        # would be a new one at every sync. Nothing else gets this session: a job made from
        # chat or with the CLI gets a session stamped at its creation (see
        # scheduler/definitions.py, ``fresh_session``), so no later job, the config's
        # included, inherits the history of a removed one.
        return self.session or f"job:{self.id}"
