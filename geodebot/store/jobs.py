"""Job definitions and fire history: the store methods for them (records.py has the rows).

A fire's row is its claim: it is written (unique per job and scheduled time) before the run
starts, and the same row then records how the fire ended. ``outcome`` moves only forward:

    requested -> running                      (a manual run picked up by the daemon)
    running   -> delivering -> ok | delivery-failed
    running   -> failed | budget              (the failure notice's delivery is in ``notice``)
    skipped-overlap, skipped-missed           (written as such; never ran)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from geodebot.store.records import (
    FireCause,
    FireEnd,
    FireRecord,
    JobRecord,
    NewOutbound,
)


class JobStore(Protocol):
    # -- definitions ----------------------------------------------------------------------
    async def jobs_sync_config(
        self, jobs: Sequence[JobRecord], *, remove_missing: bool = True
    ) -> bool:
        """Make the ``config`` jobs ``jobs``: add new ones, update changed definitions
        (keeping their pause state; a changed definition owes nothing before now) and, with
        ``remove_missing``, remove the ones gone from the config. Returns whether anything
        changed."""

    async def job_add(self, job: JobRecord) -> JobRecord:
        """Add a run-time job; :class:`StoreError` if the id is taken."""

    async def job_remove(self, job_id: str) -> bool: ...

    async def job_set_delivery(self, job_id: str, deliver_binding: str, *, creator: str) -> bool:
        """Name the binding (by key) an older row without one delivers to, and its creator
        in the same terms; changes nothing (False) unless the row has no binding yet."""

    async def job_set_paused(self, job_id: str, paused: bool, *, since_ms: int) -> JobRecord | None:
        """Pause or resume; a resume owes no fire at or before ``since_ms``."""

    async def job_get(self, job_id: str) -> JobRecord | None: ...

    async def job_list(self) -> list[JobRecord]:
        """Every job, by id."""

    async def jobs_without_binding(self) -> list[JobRecord]:
        """The jobs whose rows name no binding yet (written before bindings were recorded),
        by id; usually none, so a daemon start reads nothing more."""

    async def jobs_revision(self) -> str:
        """Changes whenever a job definition, pause state or run request changes, in any
        process; a daemon polls it to pick up changes made with the CLI."""

    # -- fires ----------------------------------------------------------------------------
    async def fire_claim(
        self, job_id: str, scheduled_ms: int, cause: FireCause, *, replica: str = ""
    ) -> tuple[FireRecord | None, bool]:
        """Claim a fire. Writes nothing and returns ``(None, False)`` while the job is
        paused, and ``(existing, False)`` if it was claimed before (also when two claims
        race). Otherwise the new row is ``running``, its ``replica`` the one given (the one
        that runs it), and ``(row, True)`` is returned, or, when another fire of the job is
        still ``running``, it is written ``skipped-overlap`` and ``(row, False)`` is
        returned."""

    async def fire_skip(
        self, job_id: str, scheduled_ms: int, cause: FireCause, reason: str
    ) -> FireRecord | None:
        """Record a fire as ``skipped-missed``; None if that fire already has a row."""

    async def fire_request(self, job_id: str, scheduled_ms: int) -> FireRecord:
        """A manual run ("fire now"): a ``requested`` row the daemon starts."""

    async def fires_requested(self) -> list[FireRecord]: ...

    async def fire_start_requested(
        self, fire_id: int, *, replica: str = ""
    ) -> tuple[FireRecord, bool]:
        """Start a ``requested`` fire as :meth:`fire_claim` starts a new one."""

    async def fire_at(self, job_id: str, scheduled_ms: int) -> FireRecord | None:
        """The fire of the job at that scheduled time, if it has a row (claimed, requested,
        skipped)."""

    async def fire_finish(
        self,
        fire_id: int,
        *,
        started_at: float,
        result: NewOutbound | None = None,
        failure: tuple[FireEnd, str] | None = None,
        notice: NewOutbound | None = None,
    ) -> FireRecord:
        """End a ``running`` fire in one transaction with its outbox row: ``result`` makes it
        ``delivering`` (settled later by :meth:`fires_settle`); ``failure`` (outcome, reason)
        makes it final, with ``notice`` posted if given. :class:`StoreError` unless the fire
        is ``running``."""

    async def fires_settle(self) -> list[FireRecord]:
        """Finish ``delivering`` fires and pending notices whose outbox rows are finished;
        returns the fires that changed."""

    async def fires_interrupted(
        self, reason: str, *, replica: str | None = None
    ) -> list[FireRecord]:
        """Turn every ``running`` fire ``failed`` with ``reason`` (with ``replica``: only the
        ones that replica claimed): only safe when none of them can still run (a start).
        The fire stays claimed, so it is never run again."""

    async def fires_orphaned(self, reason: str, *, silent_s: float) -> list[FireRecord]:
        """:meth:`fires_interrupted` for the ``running`` fires claimed over ``silent_s``
        ago whose replica has not said it is there (``replica_seen``) for ``silent_s``, or
        never did: with replicas, what one that stopped or was cut off left. Its
        :meth:`fire_finish`, should it come back, is refused."""

    async def fire_history(self, job_id: str, *, limit: int | None = None) -> list[FireRecord]:
        """Newest first."""

    async def fires_latest(self) -> dict[str, FireRecord]:
        """The newest fire of every job that has one."""

    async def fire_latest_scheduled(self, job_id: str) -> int | None:
        """The newest scheduled time (schedule or catch-up) that has a row."""

    async def fire_counts(self) -> dict[str, int]:
        """Fires by outcome, over all history."""
        ...

    async def fires_latest_scheduled(self) -> dict[str, int]:
        """:meth:`fire_latest_scheduled` of every job that has one, in one read."""
