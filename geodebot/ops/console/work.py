"""The project -> thread -> run views: ``/work`` and the timeline of ``/threads/{session}``.

Everything is read from the store at request time: bindings say which threads exist, the
session rows their last outcome, the inbox what runs now, the approval requests what waits
for a person, and the timeline what each run did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from geodebot.chat.bindings import binding_key, owns
from geodebot.config.schema import BindingConfig
from geodebot.ops.console.parts import ConsoleParts, binding_of
from geodebot.store.records import InboxRow, SessionRecord, TimelineEvent

# Events read for one page of a thread's timeline; a run cut at the page's edge is left for
# the next page unless it is the only one.
PAGE_EVENTS = 300


@dataclass(frozen=True, slots=True)
class ThreadState:
    # idle | running | waiting (for approval) | queued
    state: str
    text: str
    last_outcome: str | None = None
    last_at: float | None = None
    waiting: int = 0


@dataclass(frozen=True, slots=True)
class ThreadRow:
    session: str
    platform: str
    channel: str
    key: str
    thread: str | None
    state: ThreadState


@dataclass(frozen=True, slots=True)
class ProjectView:
    name: str
    threads: list[ThreadRow]


@dataclass(frozen=True, slots=True)
class LooseSession:
    """A session of the daemon that no binding owns: a terminal chat, a job's own session."""

    session: str
    mode: str
    state: ThreadState


@dataclass(frozen=True, slots=True)
class WorkView:
    projects: list[ProjectView]
    loose: list[LooseSession]


async def work_view(parts: ConsoleParts) -> WorkView:
    store = parts.store
    sessions = {record.id: record for record in await store.list_sessions()}
    waiting: dict[str, int] = {}
    for request in await store.approvals_pending():
        waiting[request.session_id] = waiting.get(request.session_id, 0) + 1
    running: set[str] = set()
    queued: dict[str, int] = {}
    for row in await store.inbox_unfinished():
        if row.status == "running":
            running.add(row.session_id)
        else:
            queued[row.session_id] = queued.get(row.session_id, 0) + 1

    def state_of(session_id: str) -> ThreadState:
        return thread_state(session_id, sessions.get(session_id), waiting, running, queued)

    projects: dict[str, list[ThreadRow]] = {}
    owned: set[str] = set()
    for binding in parts.bindings.all():
        threads = projects.setdefault(binding.project_name, [])
        ids = [binding.session]
        if binding.scope == "thread":
            ids += sorted(s for s in sessions if s != binding.session and owns(binding, s))
        for session_id in ids:
            owned.add(session_id)
            thread = session_id[len(binding.session) + 1 :] or None
            threads.append(
                ThreadRow(
                    session_id,
                    binding.platform,
                    binding.channel,
                    binding_key(binding),
                    thread,
                    state_of(session_id),
                )
            )
    loose = [
        LooseSession(record.id, record.mode, state_of(record.id))
        for record in sorted(sessions.values(), key=lambda r: r.updated_at, reverse=True)
        if record.id not in owned and binding_of(parts.bindings, record.id) is None
    ]
    return WorkView([ProjectView(n, t) for n, t in sorted(projects.items())], loose)


def thread_state(
    session_id: str,
    record: SessionRecord | None,
    waiting: Mapping[str, int],
    running: set[str],
    queued: Mapping[str, int],
) -> ThreadState:
    last = None if record is None else record.state.get("last_outcome")
    last_at = None if record is None or last is None else record.updated_at
    if waiting.get(session_id):
        n = waiting[session_id]
        text = f"waiting for approval ({n} call{'s' if n > 1 else ''})"
        return ThreadState("waiting", text, last, last_at, n)
    if session_id in running:
        return ThreadState("running", "running a turn", last, last_at)
    if queued.get(session_id):
        return ThreadState("queued", f"{queued[session_id]} message(s) queued", last, last_at)
    return ThreadState("idle", "idle", last, last_at)


# -- one thread's runs -------------------------------------------------------------------
@dataclass
class Run:
    """One turn as its timeline events tell it, oldest event first."""

    turn_id: str | None
    started_at: float
    outcome: str | None = None
    error: str | None = None
    rounds: int | None = None
    tokens: tuple[int, int] | None = None
    tool_calls: list[Mapping[str, Any]] = field(default_factory=list)
    refusals: list[Mapping[str, Any]] = field(default_factory=list)
    # What happened, in order: tool calls, approvals and the rest (model calls are counted).
    steps: list[TimelineEvent] = field(default_factory=list)
    model_calls: int = 0
    first_id: int = 0


@dataclass(frozen=True, slots=True)
class TimelinePage:
    runs: list[Run]
    # The ``before`` of the next (older) page; None: this page reaches the start.
    older: int | None


async def timeline_page(
    parts: ConsoleParts, session_id: str, *, before: int | None, limit: int = PAGE_EVENTS
) -> TimelinePage:
    events = await parts.store.timeline_newest(session_id, before_id=before, limit=limit)
    runs = group_runs(events)
    older: int | None = None
    if len(events) == limit:
        # The oldest run may have begun before the events read: shown whole on the next page.
        if len(runs) > 1:
            runs.pop()
        older = runs[-1].first_id
    return TimelinePage(runs, older)


async def running_now(
    parts: ConsoleParts, session_id: str, page: TimelinePage
) -> tuple[InboxRow | None, int]:
    """The message whose turn runs in the session now, when the timeline does not show that
    turn yet (a turn commits its events at its checkpoints, a turn without tool calls only at
    its end), and how many messages wait behind it."""
    running, queued = await parts.store.inbox_activity(session_id)
    newest = page.runs[0] if page.runs else None
    if newest is not None and newest.turn_id is not None and newest.outcome is None:
        # Its first round is saved: the timeline shows the running turn, steps and all.
        running = None
    return running, queued


def group_runs(newest_first: Sequence[TimelineEvent]) -> list[Run]:
    """Events (newest first) as runs, newest first; events of no turn are runs of their own."""
    runs: list[Run] = []
    by_turn: dict[str, Run] = {}
    for event in reversed(newest_first):
        run = by_turn.get(event.turn_id) if event.turn_id is not None else None
        if run is None:
            run = Run(event.turn_id, event.ts, first_id=event.id)
            runs.append(run)
            if event.turn_id is not None:
                by_turn[event.turn_id] = run
        _add(run, event)
    runs.reverse()
    return runs


def _add(run: Run, event: TimelineEvent) -> None:
    data = event.data
    if event.kind == "tool_call":
        run.tool_calls.append(data)
        if data.get("status") == "refused":
            run.refusals.append(data)
        run.steps.append(event)
    elif event.kind == "llm_call":
        run.model_calls += 1
    elif event.kind == "turn_finished":
        run.outcome = str(data.get("outcome"))
        run.error = data.get("error")
        run.rounds = data.get("rounds")
        run.tokens = (int(data.get("input_tokens", 0)), int(data.get("output_tokens", 0)))
    elif event.kind != "turn_started":
        run.steps.append(event)


def binding_rows(parts: ConsoleParts, session_id: str) -> list[BindingConfig]:
    """Every binding whose chat runs on ``session_id``."""
    exact = list(parts.bindings.with_session(session_id))
    if exact:
        return exact
    found = binding_of(parts.bindings, session_id)
    return [found] if found is not None else []
