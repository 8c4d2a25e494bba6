"""Schedules: parse cron / every / at into APScheduler triggers and list fire times.

Fire times are whole milliseconds since the epoch wherever they are stored or compared, so
the same fire computed by two processes (or before and after a restart) is the same key.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeAlias
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.cron.fields import (
    BaseField,
    DayOfMonthField,
    DayOfWeekField,
    MonthField,
    WeekField,
)
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

from geodebot.config.jobs import EVERY_PATTERN

ScheduleKind = Literal["cron", "every", "at"]
# APScheduler ships no types: its triggers are Any to mypy.
Trigger: TypeAlias = "CronTrigger | IntervalTrigger | DateTrigger"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# cron counts weekdays from Sunday = 0 (and 7); APScheduler 3.x from Monday = 0. Numbers are
# turned into names, which both read the same way.
_WEEKDAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat", "sun")
_NUMBER = re.compile(r"\d+")
# The most fire times looked at when counting what a downtime missed.
MAX_SCAN = 100_000


class ScheduleError(ValueError):
    """The schedule cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class Schedule:
    kind: ScheduleKind
    expr: str
    timezone: str
    # Interval jobs count from here (ms since the epoch), so every process computes the same
    # fire times: 0 for config jobs (aligned to the clock), creation time for the others.
    anchor_ms: int = 0

    def describe(self) -> str:
        return f"{self.kind} {self.expr} ({self.timezone})"


def to_ms(moment: datetime) -> int:
    return round(moment.timestamp() * 1000)


def from_ms(ms: int, tz: Any = UTC) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=tz)


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(f"unknown timezone {name!r}") from None


def every_seconds(text: str) -> int:
    match = EVERY_PATTERN.match(text.strip())
    if match is None:
        raise ScheduleError(f"{text!r} is not a duration like 90s, 15m, 2h or 1d")
    return int(match.group(1)) * _UNITS[match.group(2)]


def _weekday_names(field: str) -> str:
    return _NUMBER.sub(lambda m: _WEEKDAYS[int(m.group())] if int(m.group()) < 8 else "?", field)


# A cron trigger's fields in APScheduler's order, each with its class and whether it is left
# at its default: the order and flags ``CronTrigger(second=..., ..., day_of_week=...)`` gives.
_CRON_FIELDS: tuple[tuple[str, type[BaseField], bool], ...] = (
    ("year", BaseField, True),
    ("month", MonthField, False),
    ("day", DayOfMonthField, False),
    ("week", WeekField, True),
    ("day_of_week", DayOfWeekField, False),
    ("hour", BaseField, False),
    ("minute", BaseField, False),
    ("second", BaseField, False),
)


class CronFields:
    """Compiled cron fields by their text, for building many triggers.

    Compiling a field's text is most of what building a ``CronTrigger`` costs, and thousands
    of jobs share a few hundred field texts ("*", "0", "*/5", ...). A compiled field is never
    changed after it is made (a trigger only reads it), so triggers can share it. Keep one per
    batch of work (a scheduler, a config check): it grows with the distinct texts seen.
    """

    def __init__(self) -> None:
        self._compiled: dict[tuple[str, str], BaseField] = {}

    def fields(self, expr: str) -> list[BaseField]:
        """The compiled fields of ``expr``; raises :class:`ScheduleError` if it is not valid."""
        texts = _cron_texts(expr)
        compiled = self._compiled
        fields = []
        for name, cls, is_default in _CRON_FIELDS:
            key = (name, texts.get(name, "*"))
            field = compiled.get(key)
            if field is None:
                try:
                    field = compiled[key] = cls(name, key[1], is_default)
                except (ValueError, TypeError) as exc:
                    msg = f"{expr!r} is not a valid cron expression: {exc}"
                    raise ScheduleError(msg) from None
            fields.append(field)
        return fields

    def trigger(self, expr: str, tz: ZoneInfo) -> CronTrigger:
        fields = self.fields(expr)
        trigger: CronTrigger = CronTrigger.__new__(CronTrigger)
        # APScheduler's own way back from a pickled trigger (state version 2 of 3.x): the
        # same object its constructor makes from these fields (tests/unit compare them).
        trigger.__setstate__(
            {
                "version": 2,
                "timezone": tz,
                "start_date": None,
                "end_date": None,
                "fields": fields,
                "jitter": None,
            }
        )
        return trigger


def _cron_texts(expr: str) -> dict[str, str]:
    fields = expr.split()
    if len(fields) == 5:
        second, (minute, hour, day, month, weekday) = "0", fields
    elif len(fields) == 6:
        second, minute, hour, day, month, weekday = fields
    else:
        raise ScheduleError(
            f"{expr!r} has {len(fields)} fields; cron needs 5 (minute hour day month weekday) "
            "or 6 (seconds first)"
        )
    return {
        "second": second,
        "minute": minute,
        "hour": hour,
        "day": day,
        "month": month,
        "day_of_week": _weekday_names(weekday),
    }


def _at(expr: str, tz: ZoneInfo) -> DateTrigger:
    try:
        moment = datetime.fromisoformat(expr)
    except ValueError:
        raise ScheduleError(f"{expr!r} is not an ISO 8601 date and time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=tz)
    return DateTrigger(run_date=from_ms(to_ms(moment), tz), timezone=tz)


def build_trigger(schedule: Schedule, cron: CronFields | None = None) -> Trigger:
    """The schedule's trigger; ``cron`` keeps compiled cron fields for the next call."""
    tz = zone(schedule.timezone)
    if schedule.kind == "cron":
        return (cron or CronFields()).trigger(schedule.expr, tz)
    if schedule.kind == "every":
        seconds = every_seconds(schedule.expr)
        return IntervalTrigger(
            seconds=seconds, start_date=from_ms(schedule.anchor_ms, tz), timezone=tz
        )
    return _at(schedule.expr, tz)


def fire_times(schedule: Schedule, after_ms: int, trigger: Trigger | None = None) -> Iterator[int]:
    """Fire times strictly after ``after_ms``, in order (ms since the epoch); ``trigger``:
    the schedule's, when the caller has it built already."""
    trigger = build_trigger(schedule) if trigger is None else trigger
    tz = zone(schedule.timezone)
    # A far "now" makes APScheduler step from the previous fire, not from the clock.
    far = datetime(9999, 1, 1, tzinfo=UTC)
    fire = trigger.get_next_fire_time(None, from_ms(after_ms + 1, tz))
    while fire is not None:
        ms = to_ms(fire)
        if ms > after_ms:
            yield ms
        fire = trigger.get_next_fire_time(fire, far)


def next_fire(schedule: Schedule, after_ms: int, trigger: Trigger | None = None) -> int | None:
    return next(fire_times(schedule, after_ms, trigger), None)


@dataclass(frozen=True, slots=True)
class Missed:
    """Fire times in a window that nobody ran: the newest ones kept, all of them counted."""

    count: int
    latest: tuple[int, ...]
    # True when there were more than MAX_SCAN and the count stopped there.
    at_least: bool = False


def missed_between(
    schedule: Schedule, after_ms: int, upto_ms: int, keep: int, trigger: Trigger | None = None
) -> Missed:
    """Fire times in ``(after_ms, upto_ms]``; the newest ``keep`` of them are returned."""
    newest: deque[int] = deque(maxlen=max(keep, 1))
    count = 0
    for ms in fire_times(schedule, after_ms, trigger):
        if ms > upto_ms:
            break
        newest.append(ms)
        count += 1
        if count >= MAX_SCAN:
            return Missed(count, tuple(newest), at_least=True)
    return Missed(count, tuple(newest)[-keep:] if keep else ())


def check_schedule(schedule: Schedule, cron: CronFields | None = None) -> None:
    """Raise :class:`ScheduleError` if the schedule cannot be built."""
    if schedule.kind == "cron" and cron is not None:
        # What building its trigger checks, without the trigger.
        zone(schedule.timezone)
        cron.fields(schedule.expr)
        return
    build_trigger(schedule, cron)


def format_fire(ms: int, timezone: str) -> str:
    return from_ms(ms, zone(timezone)).isoformat(timespec="seconds")


def upcoming(schedule: Schedule, after_ms: int, count: int = 3) -> list[int]:
    times: list[int] = []
    for ms in fire_times(schedule, after_ms):
        times.append(ms)
        if len(times) >= count:
            break
    return times


__all__ = [
    "MAX_SCAN",
    "CronFields",
    "Missed",
    "Schedule",
    "ScheduleError",
    "ScheduleKind",
    "Trigger",
    "build_trigger",
    "check_schedule",
    "every_seconds",
    "fire_times",
    "format_fire",
    "from_ms",
    "missed_between",
    "next_fire",
    "to_ms",
    "upcoming",
]
