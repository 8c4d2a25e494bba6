"""What the console's buttons do, each on the store method its CLI command or chat button
uses. An action returns the flash message shown on the page it came from; one that cannot
be done raises :class:`Refused` with the reason, and changes nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Final

from geodebot.engine.session import COMPUTER_USE_SWITCH
from geodebot.engine.tools.spec import ToolError
from geodebot.ops.console.deadletters import letters_of
from geodebot.ops.console.pairing import decisions_of
from geodebot.ops.console.parts import OPERATOR, ConsoleParts, when
from geodebot.store.pairing import PairingRefused
from geodebot.store.records import StoreError

VIA: Final = "console"
MAX_REASON = 500
_DURATION_UNITS = {"m": 60.0, "h": 3600.0, "d": 86400.0}


class Refused(Exception):
    """An action that was not done; the message says why."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


async def decide_approval(parts: ConsoleParts, request_id: str, approve: bool) -> str:
    """The chat card's decision, made here: the first decision wins, wherever it was made."""
    decided, counted = await parts.store.approval_decide(
        request_id, approve, by=OPERATOR, via=VIA, now=parts.clock()
    )
    if decided is None:
        raise Refused(f"There is no approval request {request_id!r}.", 404)
    if parts.approvals is not None and (counted or decided.status == "expired"):
        # Wakes the turn waiting in this process and shows the outcome on its card.
        parts.approvals.decided_elsewhere(decided)
    parts.live.publish("approvals", session=decided.session_id)
    if not counted:
        if decided.status == "expired":
            raise Refused(f"The request for {decided.tool} expired; the call was not run.")
        raise Refused(
            f"Already decided: {decided.status} by {decided.decided_by} "
            f"(via {decided.decided_via}) at {when(decided.decided_at)}."
        )
    verb = "Approved" if approve else "Denied"
    return f"{verb} {decided.tool} for {decided.session_id}."


async def pause_job(parts: ConsoleParts, job_id: str, paused: bool) -> str:
    job = await parts.store.job_get(job_id)
    if job is None:
        raise Refused(f"There is no job {job_id!r}.", 404)
    if job.paused == paused:
        raise Refused(f"Job {job_id} is {'paused' if paused else 'running'} already.")
    # As `geodebot jobs pause|resume`: the store's jobs revision tells the scheduler.
    await parts.store.job_set_paused(job_id, paused, since_ms=int(parts.clock() * 1000))
    parts.live.publish("jobs", job=job_id)
    return f"Job {job_id} {'paused' if paused else 'resumed'}."


async def run_job(parts: ConsoleParts, job_id: str) -> str:
    if await parts.store.job_get(job_id) is None:
        raise Refused(f"There is no job {job_id!r}.", 404)
    latest = await parts.store.fire_history(job_id, limit=1)
    if latest and latest[0].outcome in ("requested", "running"):
        # A second press of the same button (or a reload that sends the form again) must
        # not run the job twice.
        raise Refused(f"Job {job_id} has a run {latest[0].outcome} already (fire {latest[0].id}).")
    fire = await parts.store.fire_request(job_id, int(parts.clock() * 1000))
    parts.live.publish("jobs", job=job_id)
    return f"Run of job {job_id} requested (fire {fire.id}); the scheduler starts it shortly."


async def resolve_receipt(parts: ConsoleParts, receipt_id: str, resolution: str) -> str:
    if resolution not in ("done", "failed"):
        raise Refused("A receipt is resolved as done or failed.", 400)
    receipt = await parts.store.get_receipt(receipt_id)
    if receipt is None:
        raise Refused(f"There is no receipt {receipt_id!r}.", 404)
    if receipt.resolution is not None:
        raise Refused(
            f"Already resolved: {receipt.resolution} by {receipt.resolved_by} "
            f"at {when(receipt.resolved_at)}."
        )
    try:
        resolved = await parts.store.resolve_receipt(
            receipt_id, "done" if resolution == "done" else "failed", by=OPERATOR
        )
    except StoreError as exc:
        # A concurrent resolution (the CLI) got there first, or it is not uncertain.
        raise Refused(f"Not resolved: {exc}") from exc
    parts.live.publish("receipts", session=resolved.session_id)
    return f"Receipt {resolved.id} ({resolved.tool}) resolved as {resolved.resolution}."


async def send_result(parts: ConsoleParts, form: Mapping[str, str]) -> str:
    """A run's result sent into another thread of its project, as a Thread Relay delivery
    by the operator, with its receipt."""
    if parts.relay is None:
        raise Refused("Thread Relay is not available in this daemon.", 404)
    source, turn, target = form.get("source", ""), form.get("turn", ""), form.get("target", "")
    intent = form.get("intent", "")
    if not (source and turn and target) or intent not in ("notify", "ask"):
        raise Refused("Choose the thread to send to, and notify or ask.", 400)
    try:
        delivery, new = await parts.relay.operator_send(
            source, turn, target, "ask" if intent == "ask" else "notify", by=OPERATOR
        )
    except ToolError as exc:
        raise Refused(f"Not sent: {_receipt_reason(str(exc))}") from exc
    parts.live.publish("runs", session=target)
    if not new:
        raise Refused(
            f"Already sent to {delivery.target_session}: receipt {delivery.id} "
            f"({delivery.state}) at {when(delivery.created_at)}."
        )
    return f"Sent to {delivery.target_session} ({delivery.intent}): receipt {delivery.id}."


def _receipt_reason(answer: str) -> str:
    """A refused send's reason, from the receipt the relay answers with."""
    try:
        receipt = json.loads(answer)["receipt"]
        return f"{receipt['state']}: {receipt['reason']} (receipt {receipt['id']})"
    except (ValueError, KeyError, TypeError):
        return answer


def duration_s(text: str) -> float | None:
    """ "30m", "2h", "1d" (or empty: no expiry) as seconds."""
    text = text.strip()
    if not text:
        return None
    unit = _DURATION_UNITS.get(text[-1:])
    try:
        value = float(text[:-1]) if unit is not None else math.nan
    except ValueError:
        value = math.nan
    if unit is None or not math.isfinite(value) or value <= 0 or value * unit > 366 * 86400:
        raise Refused(f"{text!r} is not a duration like 30m, 2h or 1d.", 400)
    return value * unit


async def set_computer_use(parts: ConsoleParts, form: Mapping[str, str]) -> str:
    state = form.get("state", "")
    if state not in ("on", "off"):
        raise Refused("Switch computer use on or off.", 400)
    reason = form.get("reason", "").strip()
    if not reason:
        raise Refused("Say why (the reason is kept in the switch's history).", 400)
    if len(reason) > MAX_REASON:
        raise Refused(f"The reason is longer than {MAX_REASON} characters.", 400)
    seconds = duration_s(form.get("duration", "")) if state == "on" else None
    now = parts.clock()
    switch = await parts.store.set_switch(
        COMPUTER_USE_SWITCH,
        state == "on",
        by=OPERATOR,
        expires_at=None if seconds is None else now + seconds,
        reason=reason,
    )
    parts.live.publish("operator")
    if not switch.enabled:
        return "Computer use switched off."
    until = (
        "until switched off" if switch.expires_at is None else f"until {when(switch.expires_at)}"
    )
    return f"Computer use switched on, {until}."


async def decide_deadletter(parts: ConsoleParts, letter_id: str, replay: bool) -> str:
    """As `geodebot deadletters replay|discard`, through the daemon's dead letters: a replay
    reaches its router or outbox at once. The first decision on a dead letter stands."""
    letters = letters_of(parts)
    decide = letters.replay if replay else letters.discard
    decided = await decide(letter_id, by=OPERATOR, via=VIA)
    if decided.ok:
        session = "" if decided.row is None else decided.row.session_id
        parts.live.publish("deadletters", session=session)
        return decided.message() + "."
    if decided.result == "unknown":
        raise Refused(decided.message() + ".", 404)
    d = decided.decision
    if decided.result == "already_decided" and d is not None:
        done = "replayed" if d.action == "replay" else "discarded"
        raise Refused(f"{decided.id} was already {done} by {d.by} via {d.via} at {when(d.at)}.")
    raise Refused(decided.message() + ".")


async def decide_pairing(parts: ConsoleParts, platform: str, code: str, approve: bool) -> str:
    """As `geodebot pairing approve|deny`: the request's first decision stands."""
    decisions = decisions_of(parts)
    try:
        if approve:
            record, binding = await decisions.approve(platform, code, by=OPERATOR, via=VIA)
        else:
            record = await decisions.deny(platform, code, by=OPERATOR, via=VIA)
    except ValueError as exc:
        raise Refused(str(exc), 400) from exc
    except PairingRefused as exc:
        raise Refused(f"Not decided: {exc}.") from exc
    parts.live.publish("pairing")
    who = f"{record.user} ({record.user_name})" if record.user_name else record.user
    if not approve:
        return f"Denied {platform} user {who}."
    if parts.refresh_bindings is not None:
        await parts.refresh_bindings()
    return f"Approved {platform} user {who}: {binding.key} is answered now."


async def remove_binding(parts: ConsoleParts, key: str) -> str:
    """As `geodebot bindings remove`: only a stored binding; the config's are the file's."""
    if parts.bindings.origin(key) == "config":
        raise Refused(f"{key} is a binding of the config file; edit the file to remove it.")
    removed = await decisions_of(parts).remove_binding(key, by=OPERATOR, via=VIA)
    if removed is None:
        raise Refused(f"There is no stored binding {key!r}.", 404)
    parts.live.publish("pairing")
    if parts.refresh_bindings is not None:
        await parts.refresh_bindings()
    return f"Removed {key}: its chat is no longer answered."


async def forget_memory(parts: ConsoleParts, project: str, ref: str) -> str:
    """As `geodebot memory forget ID --project P`: only the project's own item, and the
    ledger records it. Another project's id answers as no id does."""
    gone = await parts.store.memory_forget(ref, project=project)
    if gone is None:
        raise Refused(f"There is no memory item {ref!r} in project {project!r}.", 404)
    if parts.ledger is not None:
        parts.ledger.record(
            "memory_forgotten", id=gone.ref, project=gone.project, by=OPERATOR, via=VIA
        )
    parts.live.publish("memory", project=gone.project)
    who = f" by {gone.user}" if gone.user else ""
    return (
        f"Forgot {gone.ref} of project {gone.project!r} "
        f"(saved {when(gone.created_at)}, {gone.origin}{who})."
    )
