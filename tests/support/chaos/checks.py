"""Counting a chaos run: what the fakes saw, what the store holds, what the tools wrote.

:func:`tally` reads everything after the daemon was stopped and returns a
:class:`ChaosReport`: exact counts (printed by the bench and the test) and the problems found,
each one a broken promise: an acknowledged message lost or answered twice, a tool run twice
for one call or one message, a job fire run twice, a damaged store.

One duplicate is a documented limit, not a broken promise, and is counted on its own: a kill
while a Telegram part was in flight leaves its outcome unknown, the Bot API cannot look a
message up, so the outbox resends it once (README, "Outbox"). A second copy is accepted only
where the store recorded that blind resend for that very row, and both copies are identical.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geodebot.scheduler.schedule import format_fire
from tests.support.chaos.stores import ChaosStore
from tests.support.chaos.world import END, JOB_ID, JOB_SESSION, Fakes, Sent, chats

Key = tuple[str, str, str | None]  # platform, channel, the message a bot message answers


@dataclass
class ChaosReport:
    counts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        width = max((len(k) for k in self.counts), default=0)
        out = [f"{k.ljust(width)}  {v}" for k, v in self.counts.items()]
        out.append(f"{'problems'.ljust(width)}  {len(self.problems)}")
        out += [f"  PROBLEM: {p}" for p in self.problems[:40]]
        if len(self.problems) > 40:
            out.append(f"  ... and {len(self.problems) - 40} more")
        return out

    def summary(self) -> str:
        return "\n".join(self.lines())


def _bot_messages(fakes: Fakes) -> dict[Key, list[str]]:
    found: dict[Key, list[str]] = defaultdict(list)
    # A message the bot deleted (a preview a replica could not record) answers nothing.
    for chat_id, sent in fakes.telegram.sent.items():
        for m in sent:
            if (chat_id, m.message_id) in fakes.telegram.deleted:
                continue
            reply = None if m.reply_to_message_id is None else str(m.reply_to_message_id)
            # As it reads now, like the other two below (a preview edited into the answer).
            found[("telegram", str(chat_id), reply)].append(
                fakes.telegram.shown(chat_id, m.message_id).text
            )
    for channel, posted in fakes.slack.posted.items():
        for p in posted:
            if not p.deleted:
                found[("slack", channel, p.thread_ts)].append(p.text)
    for channel, created in fakes.discord.posted.items():
        for c in created:
            if str(c["id"]) in fakes.discord.deleted:
                continue
            reply = (c.get("message_reference") or {}).get("message_id")
            # As it reads now: a streamed preview was edited into the answer after it was
            # created.
            revisions = fakes.discord.revisions.get(str(c["id"]))
            text = revisions[-1].text if revisions else c["content"]
            found[("discord", channel, None if reply is None else str(reply))].append(text)
    return found


def _accepted(fakes: Fakes, sent: Sent, inbox: set[tuple[str, str]]) -> bool:
    """Acknowledged to the platform: Telegram offset confirmed, Slack envelope acked,
    Discord message seen (committed: Discord has no acknowledgement of its own)."""
    if sent.chat.platform == "telegram":
        return int(sent.event_id) < fakes.telegram.confirmed_offset
    if sent.chat.platform == "slack":
        return fakes.slack.acked(sent.envelope)
    return ("discord", sent.event_id) in inbox


def _effects(workspace: Path) -> list[tuple[str, str]]:
    """(marker, call id) of every line the tool wrote."""
    lines: list[tuple[str, str]] = []
    for path in sorted(workspace.glob("*.log")):
        for line in path.read_text().splitlines():
            if line and line != END:
                marker, _, call_id = line.partition(" ")
                lines.append((marker, call_id))
    return lines


@dataclass
class _Seen:
    """Everything the checks read, gathered once after the daemon stopped."""

    fakes: Fakes
    bot: dict[Key, list[str]]
    inbox: set[tuple[str, str]]
    inbox_rows: list[tuple[str, str, str]]
    outbox_rows: list[tuple[str, int]]
    fires: list[tuple[int, str]]
    zone: str
    uncertain: set[str]
    blind: set[tuple[str, str]]  # (platform, event id) of replies resent blind
    blind_fires: set[int]  # scheduled_ms of job posts resent blind
    effects: list[tuple[str, str]]
    # (platform, event id) -> what the store holds of the message and its replies, for a
    # problem's line: the inbox row, then each outbox row answering it.
    rows_of: dict[tuple[str, str], str]
    integrity: dict[str, Any]  # the store's own checks, to print
    damage: list[str]  # what they found wrong

    @property
    def per_marker(self) -> Counter[str]:
        return Counter(marker for marker, _ in self.effects)


def _read(fakes: Fakes, workspace: Path, store: ChaosStore) -> _Seen:
    inbox_rows = store.rows("SELECT platform, event_id, status FROM inbox")
    outbox_rows = store.rows("SELECT status, blind_resends FROM outbox")
    fires = store.rows("SELECT scheduled_ms, outcome FROM job_fires WHERE job_id = ?", (JOB_ID,))
    receipts = store.rows("SELECT call_id, status FROM effect_receipts")
    zone = store.rows("SELECT timezone FROM scheduled_jobs WHERE id = ?", (JOB_ID,))
    blind = store.rows(
        "SELECT i.platform, i.event_id FROM outbox o JOIN inbox i ON o.inbox_id = i.id"
        " WHERE o.blind_resends > 0"
    )
    blind_fires = store.rows(
        "SELECT f.scheduled_ms FROM job_fires f JOIN outbox o ON f.outbox_id = o.id"
        " WHERE o.blind_resends > 0"
    )
    integrity, damage = store.integrity()
    rows_of: dict[tuple[str, str], str] = {}
    for r in store.rows(
        "SELECT i.platform, i.event_id, i.id, i.status, i.detail, i.preview, i.pickup,"
        " o.id, o.status, o.sent_parts, o.in_flight, o.blind_resends, o.error, o.preview"
        " FROM inbox i LEFT JOIN outbox o ON o.inbox_id = i.id ORDER BY i.id, o.id"
    ):
        key = (str(r[0]), str(r[1]))
        head = rows_of.get(key) or (
            f"inbox {r[2]} {r[3]} ({r[4]}) preview={r[5]!r} taken in by {r[6]!r}"
        )
        if r[7] is not None:
            head += (
                f"; outbox {r[7]} {r[8]} parts={r[9]} in_flight={r[10]}"
                f" blind={r[11]} error={r[12]!r} preview={r[13]!r}"
            )
        rows_of[key] = head
    return _Seen(
        fakes=fakes,
        bot=_bot_messages(fakes),
        inbox={(str(p), str(e)) for p, e, _ in inbox_rows},
        inbox_rows=inbox_rows,
        outbox_rows=outbox_rows,
        fires=fires,
        zone=str(zone[0][0]) if zone else "UTC",
        uncertain={str(c) for c, status in receipts if status == "uncertain"},
        blind={(str(p), str(e)) for p, e in blind},
        blind_fires={int(ms) for (ms,) in blind_fires},
        effects=_effects(workspace),
        rows_of=rows_of,
        integrity=integrity,
        damage=damage,
    )


ALWAYS_SHOWN = (
    "accepted",
    "not accepted",
    "answered once",
    "answered once, its effect uncertain and not re-run",
    "answered once with a failure reply",
    "answered twice: Telegram part resent blind after a kill",
    "answered more than once",
    "accepted, never answered",
    "not accepted, not answered",
)


def _check_messages(seen: _Seen, report: ChaosReport) -> None:
    """Every acknowledged message answered exactly once, in its chat and thread."""
    found: Counter[str] = Counter(dict.fromkeys(ALWAYS_SHOWN, 0))
    failures: Counter[str] = Counter()
    for sent in seen.fakes.sent:
        found[f"sent {sent.chat.platform}"] += 1
        replies = seen.bot.get((sent.chat.platform, sent.chat.channel, sent.message_id), [])
        accepted = _accepted(seen.fakes, sent, seen.inbox)
        found["accepted" if accepted else "not accepted"] += 1
        if accepted and (sent.chat.platform, sent.event_id) not in seen.inbox:
            report.problems.append(f"{sent.marker} acknowledged but not in the inbox")
        verdict = _answered(seen, sent, replies, accepted, report.problems)
        found[verdict] += 1
        if verdict == "answered once with a failure reply":
            failures[replies[0][:60]] += 1
    report.counts["messages sent"] = len(seen.fakes.sent)
    for name in sorted(k for k in found if k.startswith("sent ")):
        report.counts[f"messages {name}"] = found[name]
    for name in ALWAYS_SHOWN:
        report.counts[f"messages {name}"] = found[name]
    for text, n in failures.most_common(5):
        report.counts[f"  failure reply x{n}"] = text


def _answered(
    seen: _Seen, sent: Sent, replies: list[str], accepted: bool, problems: list[str]
) -> str:
    """How one message was answered (a key of ALWAYS_SHOWN); a broken promise goes to
    ``problems``."""
    if _blind_copy(seen, sent, replies):
        return "answered twice: Telegram part resent blind after a kill"
    if len(replies) > 1:
        problems.append(
            f"{sent.marker} answered {len(replies)} times: {replies}; {_rows(seen, sent)}"
        )
        return "answered more than once"
    if len(replies) == 1 and f"done {sent.marker}" in replies[0]:
        if seen.per_marker[sent.marker] > 0:
            return "answered once"
        if any(c.startswith(f"toolu_{sent.marker}_") for c in seen.uncertain):
            return "answered once, its effect uncertain and not re-run"
        problems.append(f"{sent.marker} answered done but its tool never ran")
        return "answered once"
    if len(replies) == 1:
        return "answered once with a failure reply"
    if accepted:
        problems.append(
            f"{sent.marker} ({sent.chat.platform}) accepted but never answered; {_rows(seen, sent)}"
        )
        return "accepted, never answered"
    return "not accepted, not answered"


def _rows(seen: _Seen, sent: Sent) -> str:
    return seen.rows_of.get((sent.chat.platform, sent.event_id), "not in the inbox")


def _blind_copy(seen: _Seen, sent: Sent, replies: list[str]) -> bool:
    """Two identical Telegram replies where the outbox recorded a blind resend of this row."""
    key = (sent.chat.platform, sent.event_id)
    return (
        sent.chat.platform == "telegram"
        and key in seen.blind
        and len(replies) == 2
        and replies[0] == replies[1]
    )


def _check_strays(seen: _Seen, report: ChaosReport) -> None:
    """Every bot message answers a message sent, or is the job's post."""
    sent = {(s.chat.platform, s.chat.channel, s.message_id) for s in seen.fakes.sent}
    for key, texts in seen.bot.items():
        if key not in sent and key != _job_chat():
            report.problems.append(f"bot messages answering nothing sent: {key} {texts[:3]}")


def _check_effects(seen: _Seen, report: ChaosReport) -> None:
    """No tool call ran twice, and no message or job fire had its tool run twice."""
    per_call = Counter(call for _, call in seen.effects)
    report.counts["tool effects written"] = len(seen.effects)
    report.counts["tool calls with an uncertain receipt"] = len(seen.uncertain)
    for call, n in per_call.items():
        if n > 1:
            report.problems.append(f"tool call {call} ran {n} times")
    for marker, n in seen.per_marker.items():
        if n > 1:
            report.problems.append(f"{marker}: its tool ran {n} times")
    report.counts["tool calls run twice"] = sum(1 for n in per_call.values() if n > 1)
    twice = sum(1 for n in seen.per_marker.values() if n > 1)
    report.counts["messages/fires whose tool ran twice"] = twice


def _job_chat() -> Key:
    chat = next(c for c in chats(1) if c.session == JOB_SESSION)
    return (chat.platform, chat.channel, None)


def _check_job(seen: _Seen, report: ChaosReport) -> None:
    """Each fire time claimed once, run at most once, posted at most once."""
    counts, problems = report.counts, report.problems
    outcomes = Counter(outcome for _, outcome in seen.fires)
    counts["job fires"] = len(seen.fires)
    counts["job fires by outcome"] = dict(sorted(outcomes.items()))
    if len({ms for ms, _ in seen.fires}) != len(seen.fires):
        problems.append("a job fire time was claimed more than once")
    claimed_twice = len(seen.fires) - len({ms for ms, _ in seen.fires})
    posts = seen.bot.get(_job_chat(), [])
    resent = posted_twice = 0
    for ms, outcome in seen.fires:
        when = f"({format_fire(int(ms), seen.zone)})"
        n = sum(1 for text in posts if when in text)
        if n == 2 and int(ms) in seen.blind_fires:
            resent += 1
            n = 1
        posted_twice += n > 1
        if n > 1 or (outcome == "ok" and n != 1):
            problems.append(f"job fire {when} ({outcome}) posted {n} times")
    job_effects = sum(n for m, n in seen.per_marker.items() if m.startswith("JOB"))
    ran = sum(1 for _, outcome in seen.fires if not outcome.startswith("skipped"))
    counts["job effects written"] = job_effects
    counts["job posts"] = len(posts)
    counts["job posts resent blind after a kill"] = resent
    counts["job fires claimed or posted twice"] = claimed_twice + posted_twice
    if job_effects > ran:
        problems.append(f"{job_effects} job effects for {ran} fires that ran")


def _check_store(seen: _Seen, report: ChaosReport) -> None:
    counts = report.counts
    counts["inbox rows by status"] = dict(sorted(Counter(s for *_, s in seen.inbox_rows).items()))
    counts["outbox rows by status"] = dict(sorted(Counter(s for s, _ in seen.outbox_rows).items()))
    counts["outbox rows resent blind"] = sum(1 for _, blind in seen.outbox_rows if blind)
    counts.update(seen.integrity)
    report.problems += [f"store damaged: {d}" for d in seen.damage]


@dataclass
class ReplicaFigures:
    """What the driver saw of the replicas on its way (the store holds the rest)."""

    per_replica: dict[str, str] = field(default_factory=dict)  # name -> one line of figures
    counts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _check_replicas(store: ChaosStore, replicas: ReplicaFigures, report: ChaosReport) -> None:
    lease = store.rows("SELECT holder, epoch FROM leases WHERE name = 'daemon'")
    holder, epoch = (str(lease[0][0]), int(lease[0][1])) if lease else ("nobody", 0)
    report.counts["takeovers (final epoch - 1)"] = max(0, epoch - 1)
    report.counts["last lease holder (epoch)"] = f"{holder} ({epoch})"
    report.counts.update(replicas.counts)
    for name, line in replicas.per_replica.items():
        report.counts[f"replica {name}"] = line
    report.problems += replicas.problems


def tally(
    *,
    plan_line: str,
    fakes: Fakes,
    workspace: Path,
    store: ChaosStore,
    kills_done: int,
    kills_planned: int,
    restart_s: list[float],
    drained: bool,
    stops: dict[str, int],
    logs: list[str],
    wall_s: float,
    replicas: ReplicaFigures | None = None,
) -> ChaosReport:
    """``stops``: the exit code of each daemon's final SIGTERM stop, by name."""
    report = ChaosReport()
    counts, problems = report.counts, report.problems
    counts["plan"] = plan_line
    counts["wall time s"] = round(wall_s, 1)
    counts["kills (SIGKILL)"] = kills_done
    counts["daemon starts"] = len(restart_s)
    mean = sum(restart_s) / len(restart_s)
    counts["start-up s (mean / max)"] = f"{mean:.2f} / {max(restart_s):.2f}"
    if kills_done != kills_planned:
        problems.append(f"{kills_done} kills done of {kills_planned} planned")
    if not drained:
        problems.append("the daemon did not drain (messages unanswered or outbox pending)")
    for name, code in stops.items():
        if code != 0:
            problems.append(f"the final SIGTERM stop of {name} exited {code}")
    if replicas is not None:
        _check_replicas(store, replicas, report)
    counts["telegram getUpdates ended by a newer one (409)"] = fakes.telegram.conflicts
    seen = _read(fakes, workspace, store)
    _check_messages(seen, report)
    _check_strays(seen, report)
    _check_effects(seen, report)
    _check_job(seen, report)
    _check_store(seen, report)
    counts["daemon log lines with a traceback"] = sum(1 for line in logs if "Traceback" in line)
    return report
