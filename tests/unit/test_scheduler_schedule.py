"""Schedules: cron with 5 or 6 fields, every, at; fire times; bounded catch-up plans."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest
from apscheduler.triggers.cron import CronTrigger

from geodebot.scheduler.catch_up import MAX_CATCH_UP_RUNS, plan_catch_up
from geodebot.scheduler.schedule import (
    CronFields,
    Schedule,
    ScheduleError,
    check_schedule,
    fire_times,
    format_fire,
    missed_between,
    upcoming,
    zone,
)
from geodebot.store.records import JobRecord

# Monday 2026-11-30 10:00:00 UTC
MONDAY_10 = int(datetime(2026, 11, 30, 10, tzinfo=UTC).timestamp() * 1000)


def fires(schedule: Schedule, after_ms: int = MONDAY_10, n: int = 3) -> list[str]:
    return [format_fire(ms, schedule.timezone) for ms in upcoming(schedule, after_ms, n)]


def test_five_field_cron_with_weekday_names_and_cron_numbers_agree() -> None:
    named = Schedule("cron", "0 9 * * MON-FRI", "Europe/Berlin")
    numbered = Schedule("cron", "0 9 * * 1-5", "Europe/Berlin")
    assert (
        fires(named)
        == fires(numbered)
        == [
            "2026-12-01T09:00:00+01:00",
            "2026-12-02T09:00:00+01:00",
            "2026-12-03T09:00:00+01:00",
        ]
    )
    # cron's 0 and 7 are Sunday (APScheduler 3 counts from Monday).
    sunday = ["2026-12-06T00:00:00+00:00"]
    assert fires(Schedule("cron", "0 0 * * 0", "UTC"), n=1) == sunday
    assert fires(Schedule("cron", "0 0 * * 7", "UTC"), n=1) == sunday


def test_six_field_cron_has_seconds_first() -> None:
    assert fires(Schedule("cron", "*/20 * * * * *", "UTC")) == [
        "2026-11-30T10:00:20+00:00",
        "2026-11-30T10:00:40+00:00",
        "2026-11-30T10:01:00+00:00",
    ]


def test_every_counts_from_its_anchor_and_at_fires_once() -> None:
    assert fires(Schedule("every", "90s", "UTC")) == [
        "2026-11-30T10:01:30+00:00",
        "2026-11-30T10:03:00+00:00",
        "2026-11-30T10:04:30+00:00",
    ]
    anchored = Schedule("every", "1h", "UTC", anchor_ms=MONDAY_10 - 15 * 60_000)
    assert fires(anchored, n=1) == ["2026-11-30T10:45:00+00:00"]
    at = Schedule("at", "2026-12-24T18:00:00", "Europe/Berlin")
    assert fires(at) == ["2026-12-24T18:00:00+01:00"]
    assert fires(at, after_ms=MONDAY_10 + 365 * 86_400_000) == []


@pytest.mark.parametrize(
    ("kind", "expr", "message"),
    [
        ("cron", "* * * *", "has 4 fields"),
        ("cron", "0 25 * * *", "not a valid cron"),
        ("cron", "0 9 * * FUNDAY", "not a valid cron"),
        ("every", "0s", "not a duration"),
        ("every", "5 minutes", "not a duration"),
        ("at", "tomorrow", "not an ISO 8601"),
    ],
)
def test_bad_schedules_say_why(kind: str, expr: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        check_schedule(Schedule(kind, expr, "UTC"))  # type: ignore[arg-type]  # kinds from the bad cases


def test_missed_fires_are_counted_but_only_the_newest_kept() -> None:
    every_second = Schedule("every", "1s", "UTC")
    missed = missed_between(every_second, MONDAY_10, MONDAY_10 + 3_600_000, keep=2)
    assert missed.count == 3600
    assert missed.latest == (MONDAY_10 + 3_599_000, MONDAY_10 + 3_600_000)


def record(catch_up: str) -> JobRecord:
    return JobRecord(
        id="j",
        origin="config",
        schedule_kind="every",
        schedule="1m",
        timezone="UTC",
        anchor_ms=0,
        prompt="p",
        deliver_to="ops",
        session_id="job:j",
        tools=(),
        time_budget_s=None,
        catch_up=catch_up,  # type: ignore[arg-type]  # every literal, parametrized
        notify_on_failure=True,
        creator="",
        paused=False,
        since_ms=0,
        created_at=0.0,
        updated_at=0.0,
    )


def test_catch_up_plans_are_bounded() -> None:
    day_later = MONDAY_10 + 86_400_000
    latest = plan_catch_up(record("latest"), MONDAY_10, day_later)
    assert latest is not None
    assert latest.run_ms == (day_later,)
    assert latest.skipped_ms == day_later - 60_000
    assert latest.reason.startswith("1439 fire(s)")
    skip = plan_catch_up(record("skip"), MONDAY_10, day_later)
    assert skip is not None
    assert skip.run_ms == ()
    assert skip.skipped_ms == day_later
    assert "1440 fire(s)" in skip.reason
    everything = plan_catch_up(record("all"), MONDAY_10, day_later)
    assert everything is not None
    assert len(everything.run_ms) == MAX_CATCH_UP_RUNS
    assert everything.run_ms[-1] == day_later
    assert list(everything.run_ms) == sorted(everything.run_ms)
    assert everything.skipped_ms is not None
    assert everything.skipped_ms < everything.run_ms[0]
    assert plan_catch_up(record("latest"), MONDAY_10, MONDAY_10 + 30_000) is None
    one = plan_catch_up(record("latest"), MONDAY_10, MONDAY_10 + 60_000)
    assert one is not None
    assert one.skipped_ms is None


# (second, minute, hour, day, month, day_of_week) in APScheduler's terms, the shapes a cron
# field can take: steps, ranges, lists, names, the last day.
CRON_SHAPES = [
    ("0", "0", "9", "*", "*", "mon-fri"),
    ("*/15", "5-50/5", "*/3", "*", "*", "*"),
    ("30", "0,30", "8-18", "1,15", "*", "*"),
    ("0", "0", "0", "last", "*", "*"),
    ("0", "30", "2", "*", "3,10", "sun"),
    ("0", "0", "12", "1-7", "feb", "mon"),
    ("59", "59", "23", "31", "*", "*"),
    ("0", "0", "0", "29", "2", "*"),
]


@pytest.mark.parametrize("fields", CRON_SHAPES)
@pytest.mark.parametrize("tz", ["UTC", "Europe/Berlin", "America/New_York", "Asia/Kolkata"])
def test_cron_triggers_from_shared_fields_are_the_ones_apscheduler_builds(
    fields: tuple[str, ...], tz: str
) -> None:
    """Triggers share compiled fields (the start of 10,000 jobs compiles each text once):
    each is the trigger APScheduler's constructor makes, with the same fire times, across
    DST changes too, and sharing a field does not tie one trigger's times to another's."""
    second, minute, hour, day, month, weekday = fields
    expr = " ".join(fields)
    cron = CronFields()
    # Another trigger first, so the one compared reuses fields it compiled.
    shared = cron.trigger(f"{second} {minute} {hour} * * *", zone(tz))
    ours = cron.trigger(expr, zone(tz))
    theirs = CronTrigger(
        second=second,
        minute=minute,
        hour=hour,
        day=day,
        month=month,
        day_of_week=weekday,
        timezone=zone(tz),
    )
    assert repr(ours) == repr(theirs)
    assert [(f.name, str(f), f.is_default) for f in ours.fields] == [
        (f.name, str(f), f.is_default) for f in theirs.fields
    ]
    schedule = Schedule("cron", expr, tz)
    after = MONDAY_10 - 400 * 86_400_000
    ours_times = list(itertools.islice(fire_times(schedule, after, ours), 40))
    theirs_times = list(itertools.islice(fire_times(schedule, after, theirs), 40))
    assert ours_times == theirs_times
    assert ours_times
    # The untouched fields of the first trigger still give its own times.
    daily = Schedule("cron", f"{second} {minute} {hour} * * *", tz)
    assert upcoming(daily, after, 5) == list(itertools.islice(fire_times(daily, after, shared), 5))


def test_a_bad_field_is_refused_each_time_and_a_good_one_after_it_builds() -> None:
    cron = CronFields()
    for _ in range(2):
        with pytest.raises(ScheduleError, match="not a valid cron expression"):
            cron.fields("0 0 25 * * *")
        with pytest.raises(ScheduleError, match="not a valid cron expression"):
            check_schedule(Schedule("cron", "0 25 * * *", "UTC"), cron)
    with pytest.raises(ScheduleError, match="unknown timezone"):
        check_schedule(Schedule("cron", "0 9 * * *", "Mars/Olympus"), cron)
    check_schedule(Schedule("cron", "0 9 * * *", "UTC"), cron)
    assert fires(Schedule("cron", "0 23 * * *", "UTC"), n=1) == ["2026-11-30T23:00:00+00:00"]
