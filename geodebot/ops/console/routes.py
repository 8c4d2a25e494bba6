"""The console's route table: each page (its path, title, template and what it reads) and
each action (its path, what it does, the page it returns to). A new page or action is one
entry here, its template, and, for a page, a nav entry it gets from ``nav=True``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from geodebot.ops.console import actions
from geodebot.ops.console.boards import approvals_view, jobs_view, operator_view, receipts_view
from geodebot.ops.console.deadletters import attention, deadletters_view, letter_view, letters_of
from geodebot.ops.console.memory import memory_view
from geodebot.ops.console.pairing import pairing_view
from geodebot.ops.console.parts import ConsoleParts
from geodebot.ops.console.target import target_of
from geodebot.ops.console.work import binding_rows, running_now, timeline_page, work_view

Context = dict[str, Any]
Load = Callable[[ConsoleParts, web.Request], Awaitable[Context]]
Act = Callable[[ConsoleParts, web.Request, Mapping[str, str]], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Page:
    path: str
    title: str
    template: str
    load: Load
    nav: bool = True


@dataclass(frozen=True, slots=True)
class Action:
    path: str
    act: Act
    # Where the browser goes afterwards unless the form names a page of its own (``back``).
    back: str


class NotFound(Exception):
    """The page's subject does not exist; the message says what was looked for."""


async def _work(parts: ConsoleParts, request: web.Request) -> Context:
    budgets = None
    if parts.spend_status is not None:
        # What /healthz shows as "budgets": today's use of each limited budget.
        _, budgets = await parts.spend_status()
    return {"work": await work_view(parts), "budgets": budgets, "attention": await attention(parts)}


async def _thread(parts: ConsoleParts, request: web.Request) -> Context:
    session_id = request.match_info["session"]
    bindings = binding_rows(parts, session_id)
    record = await parts.store.get_session(session_id)
    if record is None and not bindings:
        raise NotFound(f"There is no session {session_id!r}.")
    before_text = request.query.get("before", "")
    before = int(before_text) if before_text.isdigit() else None
    page = await timeline_page(parts, session_id, before=before)
    running, queued = (
        (None, 0) if before is not None else await running_now(parts, session_id, page)
    )
    target = await target_of(parts, session_id, bindings[0]) if bindings else None
    pending = await parts.store.approvals_pending(session_id=session_id)
    send_to: list[str] = []
    if parts.relay is not None and bindings:
        send_to = await parts.relay.project_threads(session_id)
    return {
        "session_id": session_id,
        "record": record,
        "bindings": bindings,
        "page": page,
        "before": before,
        "running": running,
        "queued": queued,
        "target": target,
        "pending": pending,
        "send_to": send_to,
    }


async def _jobs(parts: ConsoleParts, request: web.Request) -> Context:
    return {"jobs": await jobs_view(parts)}


async def _receipts(parts: ConsoleParts, request: web.Request) -> Context:
    return {"receipts": await receipts_view(parts)}


async def _approvals(parts: ConsoleParts, request: web.Request) -> Context:
    return {"approvals": await approvals_view(parts)}


async def _deadletters(parts: ConsoleParts, request: web.Request) -> Context:
    offset_text = request.query.get("offset", "")
    offset = int(offset_text) if offset_text.isdigit() else 0
    return {"letters": await deadletters_view(parts, offset=offset)}


async def _deadletter(parts: ConsoleParts, request: web.Request) -> Context:
    letter_id = request.match_info["id"]
    found = await letters_of(parts).show(letter_id)
    if found is None:
        raise NotFound(f"There is no dead letter {letter_id!r} (ids look like in-12 or out-5).")
    return {"view": letter_view(found)}


async def _pairing(parts: ConsoleParts, request: web.Request) -> Context:
    return {"pairing": await pairing_view(parts)}


async def _memory(parts: ConsoleParts, request: web.Request) -> Context:
    query = request.query
    project = query.get("project") or None
    before = query.get("before") or None
    return {"memory": await memory_view(parts, project, query.get("q", ""), before)}


async def _operator(parts: ConsoleParts, request: web.Request) -> Context:
    return {"operator": await operator_view(parts)}


PAGES: tuple[Page, ...] = (
    Page("/work", "Work", "work.html", _work),
    Page("/threads/{session:.+}", "Thread", "thread.html", _thread, nav=False),
    Page("/jobs", "Jobs", "jobs.html", _jobs),
    Page("/approvals", "Approvals", "approvals.html", _approvals),
    Page("/receipts", "Receipts", "receipts.html", _receipts),
    Page("/deadletters", "Dead letters", "deadletters.html", _deadletters),
    Page("/deadletters/{id}", "Dead letter", "deadletter.html", _deadletter, nav=False),
    Page("/pairing", "Pairing", "pairing.html", _pairing),
    Page("/memory", "Memory", "memory.html", _memory),
    Page("/operator", "Operator", "operator.html", _operator),
)


async def _approve(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    return await actions.decide_approval(parts, request.match_info["id"], True)


async def _deny(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    return await actions.decide_approval(parts, request.match_info["id"], False)


async def _pause(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    return await actions.pause_job(parts, request.match_info["id"], True)


async def _resume(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    return await actions.pause_job(parts, request.match_info["id"], False)


async def _run(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    return await actions.run_job(parts, request.match_info["id"])


async def _resolve(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    return await actions.resolve_receipt(parts, request.match_info["id"], form.get("as", ""))


async def _send(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    return await actions.send_result(parts, form)


async def _replay(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    return await actions.decide_deadletter(parts, request.match_info["id"], True)


async def _discard(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    return await actions.decide_deadletter(parts, request.match_info["id"], False)


async def _computer_use(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    return await actions.set_computer_use(parts, form)


async def _pair(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    info = request.match_info
    return await actions.decide_pairing(parts, info["platform"], info["code"], True)


async def _unpair(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    info = request.match_info
    return await actions.decide_pairing(parts, info["platform"], info["code"], False)


async def _unbind(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    return await actions.remove_binding(parts, request.match_info["key"])


async def _forget(parts: ConsoleParts, request: web.Request, form: Mapping[str, str]) -> str:
    info = request.match_info
    return await actions.forget_memory(parts, info["project"], info["ref"])


ACTIONS: tuple[Action, ...] = (
    Action("/approvals/{id}/approve", _approve, "/approvals"),
    Action("/approvals/{id}/deny", _deny, "/approvals"),
    Action("/jobs/{id}/pause", _pause, "/jobs"),
    Action("/jobs/{id}/resume", _resume, "/jobs"),
    Action("/jobs/{id}/run", _run, "/jobs"),
    Action("/receipts/{id}/resolve", _resolve, "/receipts"),
    Action("/deadletters/{id}/replay", _replay, "/deadletters"),
    Action("/deadletters/{id}/discard", _discard, "/deadletters"),
    Action("/pairing/{platform}/{code}/approve", _pair, "/pairing"),
    Action("/pairing/{platform}/{code}/deny", _unpair, "/pairing"),
    Action("/bindings/{key}/remove", _unbind, "/pairing"),
    # A project is a binding's project or session, which may hold a "/".
    Action("/memory/{project:.+}/{ref}/forget", _forget, "/memory"),
    Action("/operator/computer-use", _computer_use, "/operator"),
    Action("/relay/send", _send, "/work"),
)
