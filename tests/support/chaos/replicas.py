"""Several replicas of ``geodebot serve`` on one PostgreSQL database, killed and paused at
seeded points (:class:`tests.support.chaos.plan.ReplicaEvent`), and what was seen of them.

Each replica has its own config file and state directory, the same config otherwise: the
fakes (one Telegram token, one Slack app, one Discord bot) and the tool's workspace are
shared. Every replica serves the sessions it holds and runs the scheduler (a job's fires run
on the replica holding its session); one, the leader, holds the daemon's lease
(replicas/daemon_lease.py) and with it Telegram's poller and Discord's gateway. Here "serving" means
leading.

- A kill SIGKILLs one of the replicas running then (leading or not) and restarts it after its
  down time.
- A pause SIGSTOPs the leader, holds it past the lease's time to live and until another
  replica holds the lease, then SIGCONTs it: it must notice its lease is gone, commit and send
  nothing, and exit 1; it is then started again, as a member.
- At least one replica is always running: an event waits until another one is.
- A replica that exits on its own is started again; an exit 1 for a lost lease (a replica
  starved of CPU past its lease's time to live) is counted, anything else is a problem.

Which replica served when is logged as it happens (``say``) and summed per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import psycopg

from geodebot.replicas.daemon_lease import LEAD_MARK, MEMBER_MARK
from tests.support.chaos.checks import ReplicaFigures
from tests.support.chaos.plan import ChaosPlan, ReplicaEvent
from tests.support.chaos.traffic import Traffic
from tests.support.daemon import READY_MARK, DaemonProcess

# replicas/daemon_lease.py: "replica <id> lost lease 'daemon': <why>"
LOST_MARK = "lost lease"
# What a replica that lost its lease logs when the store or the outbox refuses its work.
REFUSED_MARKS = (
    "refused: the lease is held by",
    "its session's lease is lost",
    "its session's lease is not held here",
)
State = Literal["starting", "up", "paused", "down"]


class ReplicaProcess(DaemonProcess):
    """One run of a replica's daemon: started once it serves or stands by, whichever it logs
    first; when it began to serve and stopped serving, by the driver's clock."""

    def __init__(self, config: Path, env: dict[str, str], on_serving: Callable[[str], None]):
        super().__init__(config, env)
        self.serving_since: float | None = None
        self.lost_at: float | None = None  # when it logged that its lease was lost
        self.resumed_from: int | None = None  # its first log line after a SIGCONT
        self.ended: float | None = None
        self.planned_exit = False  # the driver killed, paused or stopped it
        self._on_serving = on_serving

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.log.append(line)
            if LEAD_MARK in line and self.serving_since is None:
                self.serving_since = time.monotonic()
                self._on_serving(line)
            if LEAD_MARK in line or MEMBER_MARK in line:
                self._ready.set()
            if LOST_MARK in line and self.lost_at is None:
                self.lost_at = time.monotonic()
        self.end()

    def end(self) -> None:
        if self.ended is None:
            self.ended = time.monotonic()

    def serving_s(self, now: float) -> float:
        if self.serving_since is None:
            return 0.0
        return (self.ended or now) - self.serving_since


@dataclass
class Replica:
    name: str
    config: Path
    state: State = "down"
    runs: list[ReplicaProcess] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)
    kills: int = 0
    pauses: int = 0

    @property
    def run(self) -> ReplicaProcess:
        return self.runs[-1]


_EPOCH = re.compile(r"\(epoch (\d+)\)")
_DISCORD_CURSORS = "SELECT count(*) FROM cursors WHERE name LIKE 'discord:last:%'"
_HOLDER = (
    "SELECT holder, epoch FROM leases WHERE name = 'daemon'"
    " AND expires_at > EXTRACT(EPOCH FROM clock_timestamp())"
)


class Fleet:
    """``async with Fleet(...)``: every replica is killed on the way out, whatever happened."""

    def __init__(
        self,
        plan: ChaosPlan,
        configs: dict[str, Path],
        env: dict[str, str],
        url: str,
        say: Callable[[str], None],
    ) -> None:
        self.plan = plan
        self.replicas = [Replica(name, config) for name, config in configs.items()]
        self.env = env
        self.url = url
        self.say = say
        self.figures = ReplicaFigures()
        self.start_s: list[float] = []
        self.kills_done = 0
        self.pauses_begun = self.pauses_done = 0
        self.refused_after_resume = 0
        self.lost_unpaused = 0
        self.resumes: list[str] = []  # per pause: SIGCONT to "lost lease" / to the exit
        self.closing = False
        self._changed = asyncio.Condition()
        self._watchers: set[asyncio.Task[None]] = set()
        self._db: psycopg.AsyncConnection[tuple[object, ...]] | None = None
        self._db_lock = asyncio.Lock()

    async def __aenter__(self) -> Fleet:
        self._db = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.closing = True
        # The watchers first: one restarting a replica meanwhile would leave a daemon (and
        # its pipes) behind after the kills below.
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for replica in self.replicas:
            for run in replica.runs:
                if run.proc is not None and run.proc.returncode is None:
                    run.planned_exit = True
                    run.proc.send_signal(signal.SIGCONT)
                await run.kill()
        if self._db is not None:
            await self._db.close()

    def logs(self) -> list[str]:
        """Every log line, but a paused replica's after its SIGCONT: its refused work."""
        return [
            line for r in self.replicas for run in r.runs for line in run.log[: run.resumed_from]
        ]

    def _after_resumes(self) -> list[str]:
        runs = [run for r in self.replicas for run in r.runs if run.resumed_from is not None]
        return [line for run in runs for line in run.log[run.resumed_from :]]

    def keep_logs(self) -> None:
        """Each run's log beside its replica's config: ``r2/run-1.log``."""
        for r in self.replicas:
            for n, run in enumerate(r.runs, 1):
                (r.config.parent / f"run-{n}.log").write_text(run.text() + "\n")

    def _up(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == "up"]

    def _may_stop_one(self) -> bool:
        # One replica alone may be killed (as the single daemon is), never paused.
        return len(self._up()) >= min(2, len(self.replicas))

    async def holder(self) -> tuple[str, int] | None:
        """The lease's holder and epoch, unless the lease expired."""
        row = await self._row(_HOLDER)
        return None if row is None else (str(row[0]), int(str(row[1])))

    async def _query(self, sql: str) -> int:
        row = await self._row(sql)
        return 0 if row is None else int(str(row[0]))

    async def _row(self, sql: str) -> tuple[object, ...] | None:
        assert self._db is not None
        async with self._db_lock:
            return await (await self._db.execute(sql)).fetchone()  # type: ignore[arg-type]

    # -- starting ---------------------------------------------------------------------------
    async def start_all(self, discord_channels: int, timeout_s: float = 60) -> None:
        """All at once, on a database none of them migrated yet, as a deployment starts; then
        until one serves with its channels connected and each bound Discord channel has its
        first cursor, as the single daemon has before the first message. (Before its first
        cursor, a Discord channel's first connection skips the history before it by design:
        a deployment whose first server lost its lease before saving that cursor loses what
        came meanwhile; that window is the deployment's first seconds.)"""
        await asyncio.gather(*(self._start(r) for r in self.replicas))

        async def established() -> bool:
            if not any(READY_MARK in line for r in self.replicas for line in r.run.log):
                return False
            return await self._query(_DISCORD_CURSORS) >= discord_channels

        async with asyncio.timeout(timeout_s):
            await _polled(established)

    async def _start(self, replica: Replica) -> None:
        async with self._changed:
            replica.state = "starting"
        run = ReplicaProcess(replica.config, self.env, lambda line: self._serving(replica, line))
        replica.runs.append(run)
        began = time.monotonic()
        await run.start(timeout_s=60)
        self.start_s.append(time.monotonic() - began)
        watcher = asyncio.create_task(self._watch(replica, run))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        async with self._changed:
            replica.state = "up"
            self._changed.notify_all()

    def _serving(self, replica: Replica, line: str) -> None:
        found = _EPOCH.search(line)
        self.say(f"{replica.name} serves (epoch {found.group(1) if found else '?'})")

    async def _watch(self, replica: Replica, run: ReplicaProcess) -> None:
        """A replica that exits without the driver asking is started again, as a standby."""
        assert run.proc is not None
        code = await run.proc.wait()
        async with self._changed:
            if run.planned_exit or self.closing:
                return
            replica.state = "down"
            self._changed.notify_all()
        run.end()
        replica.exits.append(code)
        if code == 1 and any(LOST_MARK in line for line in run.log):
            self.lost_unpaused += 1
            self.say(f"{replica.name} lost its lease unpaused and exited 1; starting it again")
        else:
            tail = " | ".join(run.log[-5:])
            self.figures.problems.append(f"{replica.name} exited {code} on its own: {tail}")
        await self._start(replica)

    # -- the events -------------------------------------------------------------------------
    async def run_events(self, events: list[ReplicaEvent], traffic: Traffic) -> None:
        await asyncio.gather(*(self._event(e, traffic) for e in events))

    async def _event(self, event: ReplicaEvent, traffic: Traffic) -> None:
        await traffic.sent_past(event.after_message)
        await asyncio.sleep(event.delay_s)
        if event.kind == "kill":
            await self._kill(event)
        else:
            await self._pause(event)

    async def _kill(self, event: ReplicaEvent) -> None:
        async with self._changed:
            await self._changed.wait_for(self._may_stop_one)
            up = self._up()
            replica = up[min(int(event.pick * len(up)), len(up) - 1)]
            replica.state = "down"
            run = replica.run
            run.planned_exit = True
        run.end()
        await run.kill()
        assert run.proc is not None
        assert run.proc.returncode is not None
        replica.exits.append(run.proc.returncode)
        replica.kills += 1
        self.kills_done += 1
        role = "serving" if run.serving_since is not None else "standing by"
        self.say(
            f"kill {self.kills_done}/{self.plan.kills}: {replica.name} ({role})"
            f" after message {event.after_message}, down {event.hold_s:.2f} s"
        )
        await asyncio.sleep(event.hold_s)
        await self._start(replica)

    async def _pause(self, event: ReplicaEvent) -> None:
        replica, epoch = await self._claim_serving()
        run = replica.run
        assert run.proc is not None
        run.end()
        run.proc.send_signal(signal.SIGSTOP)
        replica.pauses += 1
        self.pauses_begun += 1
        hold = self.plan.lease_ttl_s + event.hold_s
        self.say(
            f"pause {self.pauses_begun}/{self.plan.pauses}: {replica.name} (serving, epoch"
            f" {epoch}) after message {event.after_message}, stopped {hold:.2f} s at least"
        )
        await asyncio.sleep(hold)
        if not await self._taken_from(replica.name, timeout_s=60):
            self.figures.problems.append(f"no replica took over while {replica.name} was paused")
        resumed, resumed_at = len(run.log), time.monotonic()
        run.resumed_from = resumed
        run.proc.send_signal(signal.SIGCONT)
        try:
            async with asyncio.timeout(30):
                code = await run.proc.wait()
        except TimeoutError:
            self.figures.problems.append(f"{replica.name} still ran 30 s after its SIGCONT")
        await run.kill()
        code = run.proc.returncode
        assert code is not None
        replica.exits.append(code)
        after = run.log[resumed:]
        self.refused_after_resume += sum(1 for line in after if _refused(line))
        if code != 1:
            self.figures.problems.append(f"{replica.name} exited {code} after its pause, not 1")
        # It notices by its lease's deadline ("lost lease"), or first by a write the store
        # refused, which stops it too.
        if not any(LOST_MARK in line or _refused(line) for line in after):
            self.figures.problems.append(f"{replica.name} never noticed its lease was lost")
        self.pauses_done += 1
        exited_s = time.monotonic() - resumed_at
        noticed = "refused write" if run.lost_at is None else f"{run.lost_at - resumed_at:.2f} s"
        self.resumes.append(f"{noticed} / {exited_s:.1f} s")
        self.say(
            f"{replica.name} resumed: lease lost noticed after {noticed}, exited {code}"
            f" after {exited_s:.1f} s; starting it again"
        )
        await self._start(replica)

    async def _claim_serving(self) -> tuple[Replica, int]:
        """The replica serving now, once it is running and another one is too; marked paused."""
        while True:
            held = await self.holder()
            async with self._changed:
                up = self._up()
                found = [r for r in up if held is not None and r.name == held[0]]
                if found and len(up) >= 2 and found[0].run.serving_since is not None:
                    found[0].state = "paused"
                    found[0].run.planned_exit = True
                    assert held is not None
                    return found[0], held[1]
            await asyncio.sleep(0.1)

    async def _taken_from(self, name: str, timeout_s: float) -> bool:
        async def taken() -> bool:
            held = await self.holder()
            return held is not None and held[0] != name

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await _polled(taken)
                return True
        return False

    # -- the end ----------------------------------------------------------------------------
    async def stop_all(self) -> dict[str, int]:
        """SIGTERM each replica, the serving one last (stopped first, it would hand over);
        the exit codes, by replica."""
        async with asyncio.timeout(120), self._changed:
            await self._changed.wait_for(lambda: len(self._up()) == len(self.replicas))
        self.closing = True
        held = await self.holder()
        serving = held[0] if held is not None else None
        stops: dict[str, int] = {}
        for replica in sorted(self.replicas, key=lambda r: r.name == serving):
            run = replica.run
            run.planned_exit = True
            run.end()
            code = await run.stop(timeout_s=60)
            replica.exits.append(code)
            stops[replica.name] = code
        return stops

    def report(self) -> ReplicaFigures:
        now = time.monotonic()
        figures = self.figures
        for r in self.replicas:
            served = sum(run.serving_s(now) for run in r.runs)
            took = sum(1 for run in r.runs if run.serving_since is not None)
            figures.per_replica[r.name] = (
                f"served {served:.1f} s in {took} runs of {len(r.runs)}, kills {r.kills},"
                f" pauses {r.pauses}, exit codes {r.exits}"
            )
        counts = figures.counts
        counts["replicas"] = len(self.replicas)
        counts["pauses (SIGSTOP past the lease TTL)"] = self.pauses_done
        counts["after SIGCONT: lease loss logged / exit, per pause"] = ", ".join(self.resumes)
        counts["writes/sends refused after SIGCONT"] = self.refused_after_resume
        after = self._after_resumes()
        counts["log lines with a traceback after SIGCONT"] = sum("Traceback" in x for x in after)
        counts["leases lost without a pause (exit 1)"] = self.lost_unpaused
        if self.pauses_done != self.plan.pauses:
            figures.problems.append(f"{self.pauses_done} pauses done of {self.plan.pauses}")
        return figures


async def _polled(check: Callable[[], Awaitable[bool]], every_s: float = 0.05) -> None:
    """Until ``check`` holds: what the driver waits for is in other processes and the
    database, which notify nobody."""
    while True:
        if await check():
            return
        await asyncio.sleep(every_s)


def _refused(line: str) -> bool:
    return any(mark in line for mark in REFUSED_MARKS)
