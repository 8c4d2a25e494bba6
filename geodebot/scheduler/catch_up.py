"""What to do about fires owed from a downtime, per the job's ``catch_up``, bounded."""

from __future__ import annotations

from dataclasses import dataclass

from geodebot.scheduler.definitions import schedule_of
from geodebot.scheduler.schedule import ScheduleError, Trigger, format_fire, missed_between
from geodebot.store.records import JobRecord

# catch_up = "all" runs at most this many of the newest missed fires, one after the other.
MAX_CATCH_UP_RUNS = 5


@dataclass(frozen=True, slots=True)
class CatchUpPlan:
    run_ms: tuple[int, ...]
    # One skipped-missed row stands for every missed fire that will not run.
    skipped_ms: int | None
    reason: str


def plan_catch_up(
    job: JobRecord, after_ms: int, upto_ms: int, trigger: Trigger | None = None
) -> CatchUpPlan | None:
    """None when nothing was missed in ``(after_ms, upto_ms]``; ``trigger``: the job's, when
    the caller has it built already."""
    keep = MAX_CATCH_UP_RUNS + 1
    try:
        missed = missed_between(schedule_of(job), after_ms, upto_ms, keep, trigger)
    except ScheduleError:
        return None
    if missed.count == 0:
        return None
    runs = {"latest": 1, "skip": 0, "all": MAX_CATCH_UP_RUNS}[job.catch_up]
    run_ms = missed.latest[-runs:] if runs else ()
    not_run = missed.count - len(run_ms)
    if not_run == 0:
        return CatchUpPlan(tuple(run_ms), None, "")
    skipped_ms = missed.latest[-len(run_ms) - 1]
    first_kept = missed.latest[0] if missed.count <= len(missed.latest) else None
    span = f"up to {format_fire(skipped_ms, job.timezone)}"
    if first_kept is not None and first_kept != skipped_ms:
        span = f"from {format_fire(first_kept, job.timezone)} {span}"
    count = f"{'at least ' if missed.at_least else ''}{not_run}"
    why = {
        "latest": "catch_up = latest runs only the newest",
        "skip": "catch_up = skip",
        "all": f"catch_up = all runs at most the newest {MAX_CATCH_UP_RUNS}",
    }[job.catch_up]
    reason = f"{count} fire(s) {span} missed while the daemon was not running; {why}"
    return CatchUpPlan(tuple(run_ms), skipped_ms, reason)
