"""Replicas sharing the work on one PostgreSQL store, in one process: each replica is a real app
with its own store connection, router, outbox, session leases and pick-up loop (what
app/daemon.py wires with ``[store] url``), and its own in-memory chat connection.

A session's turns run on the replica that holds its lease (replicas/leases.py); a message another
replica takes in waits for that one (replicas/pickup.py); a replica that stops renewing loses its
sessions to the others, which answer what it left, once, and what it still writes is refused.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.build import App
from geodebot.channels.base import Inbound, Press, PressAnswer
from geodebot.chat.approvals import ChatApprovals
from geodebot.chat.outbox import OutboxSender
from geodebot.chat.router import ChatRouter
from geodebot.replicas.leases import SessionLeases, lease_name
from geodebot.replicas.owner import LeasedOwner
from geodebot.replicas.pickup import SessionPickUps
from geodebot.replicas.takeup import SessionTakeUp
from geodebot.testing import MemoryChannel
from tests.support.chat import chat_pipeline
from tests.support.fakes.llm_server import Call, Delay, FakeLLMServer, Reply
from tests.support.postgres import Cluster
from tests.support.replicas import replica_app
from tests.support.tools import marker_lines
from tests.support.waiting import until

ids = itertools.count(5000)
TTL_S = 3.0
APPROVER = "4242"

BINDINGS = [
    {"platform": "telegram", "channel": f"c{n}", "session": f"s{n}", "allowed_users": ["*"]}
    for n in range(1, 5)
] + [
    {
        "platform": "telegram",
        "channel": "c9",
        "session": "deploys",
        "allowed_users": ["*"],
        "tools": ["write_marker"],
        "approvers": [APPROVER],
    }
]


def message(text: str, channel: str) -> Inbound:
    n = next(ids)
    return Inbound(
        platform="telegram",
        event_id=str(n),
        channel=channel,
        thread=None,
        user="u1",
        text=text,
        message_id=f"m{n}",
    )


@dataclass
class Replica:
    name: str
    app: App
    router: ChatRouter
    outbox: OutboxSender
    leases: SessionLeases
    chat: MemoryChannel
    pickups: SessionPickUps
    approvals: ChatApprovals
    takeup: SessionTakeUp

    def texts(self, channel: str) -> list[str]:
        return [p.text for p in self.chat.sent if p.destination.channel == channel]


@asynccontextmanager
async def replica(
    name: str, url: str, tmp_path: Path, llm: FakeLLMServer, *, paused: bool = False
) -> AsyncIterator[Replica]:
    """``paused``: it takes in and runs what it is given, but renews no lease and looks for
    no work, as a process that stopped being scheduled right after would."""
    async with (
        AsyncExitStack() as stack,
        replica_app(name, url, tmp_path, llm, stack, bindings=BINDINGS, ttl_s=TTL_S) as (
            _config,
            app,
            leases,
        ),
    ):
        store = app.services.store
        chat = MemoryChannel("telegram")
        owner = LeasedOwner(store, leases)
        chat_path = chat_pipeline(
            app, {"telegram": chat}, owner=owner, streams=False, max_chars={"telegram": 4000}
        )
        router, outbox, approvals = chat_path.router, chat_path.outbox, chat_path.approvals
        takeup = SessionTakeUp(store, router, owner)
        pickups = SessionPickUps(store, leases, takeup.take_up, outbox.kick, poll_s=0.5)
        if not paused:
            await stack.enter_async_context(leases)
        await stack.enter_async_context(chat_path)
        await chat.start(router.accept, approvals.press)
        looking = asyncio.create_task(pickups.run() if not paused else asyncio.sleep(0))
        try:
            yield Replica(name, app, router, outbox, leases, chat, pickups, approvals, takeup)
        finally:
            looking.cancel()
            await asyncio.gather(looking, return_exceptions=True)
            await chat.stop()


@pytest.fixture
def url(postgres_cluster: Cluster) -> str:
    return postgres_cluster.new_database(migrated=True)


async def meet(*replicas: Replica) -> None:
    """Each says it is there (as the daemon's lease does every quarter TTL) and each reads
    who is: their views of where sessions belong agree."""
    for one in replicas:
        await one.app.services.store.replica_seen(one.name, role="member", host="h", pid=1)
    for one in replicas:
        await one.leases.refresh_members()


def homed_at(one: Replica) -> tuple[str, str]:
    """A bound session (and its channel) whose home is ``one``."""
    for n in range(1, 5):
        if one.leases.is_home(f"s{n}"):
            return f"s{n}", f"c{n}"
    raise AssertionError(f"no session of the bindings is homed at {one.name}")


async def test_a_session_runs_on_its_holder_whichever_replica_takes_its_messages_in(
    url: str, tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("answer 1"), Reply("answer 2"))
    async with (
        replica("alpha", url, tmp_path, llm_server) as alpha,
        replica("beta", url, tmp_path, llm_server) as beta,
    ):
        await meet(alpha, beta)
        session, channel = homed_at(alpha)
        await alpha.chat.deliver(message("first", channel))
        await until(lambda: len(alpha.texts(channel)) == 1, "alpha's first answer")
        assert alpha.leases.held() == [session]
        # The session's next message reaches beta's connection (Slack spreads them): alpha,
        # which holds it, answers it, once, in order after the first.
        await beta.chat.deliver(message("second", channel))
        await until(lambda: len(alpha.texts(channel)) == 2, "alpha's second answer")
        store = alpha.app.services.store
        await until(lambda: _all_finished(store), "every row finished")
        assert alpha.texts(channel) == ["answer 1", "answer 2"]
        assert beta.texts(channel) == []
        assert beta.router.counters["elsewhere"] == 1
        assert alpha.pickups.picked == 1
        assert beta.leases.held() == []
        lease = await store.lease(lease_name(session))
        assert lease is not None
        assert lease.holder == "alpha"
    # Let go at the end: nobody waits for them to expire.
    assert [(x.name, x.remaining_s <= 0) for x in await _leases(url)] == [
        (lease_name(session), True)
    ]


async def test_sessions_spread_over_the_replicas_however_their_messages_come_in(
    url: str, tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # Every message comes in on alpha's connection, as Telegram's poller brings them all to
    # one replica; each session still goes to its home (rendezvous hashing over the
    # replicas that said they are there), and each message is answered once, by it.
    llm_server.default = Reply("answered at home")
    async with (
        replica("alpha", url, tmp_path, llm_server) as alpha,
        replica("beta", url, tmp_path, llm_server) as beta,
    ):
        for one in (alpha, beta):
            await one.app.services.store.replica_seen(one.name, role="member", host="h", pid=1)
        for one in (alpha, beta):
            await one.leases.refresh_members()
        homes = {f"s{n}": alpha.leases.home(f"s{n}") for n in range(1, 5)}
        assert homes == {sid: beta.leases.home(sid) for sid in homes}
        # The hash spreads these four over both (fixed names, so a fixed outcome).
        assert set(homes.values()) == {"alpha", "beta"}
        for round_ in range(2):
            for n in range(1, 5):
                await alpha.chat.deliver(message(f"round {round_}", f"c{n}"))
        replicas = {"alpha": alpha, "beta": beta}
        for n in range(1, 5):
            home = replicas[homes[f"s{n}"]]
            await until(lambda h=home, c=f"c{n}": len(h.texts(c)) == 2, f"c{n}'s answers")
        store = alpha.app.services.store
        await until(lambda: _all_finished(store), "every row finished")
        for sid, home in homes.items():
            lease = await store.lease(lease_name(sid))
            assert lease is not None
            assert lease.holder == home
            channel = f"c{sid[1:]}"
            other = beta if home == "alpha" else alpha
            assert other.texts(channel) == []
        assert sorted(alpha.leases.held() + beta.leases.held()) == sorted(homes)
    assert len(llm_server.requests) == 8


async def test_a_press_another_replica_takes_in_decides_the_turn_waiting_on_the_holder(
    url: str, tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # The card is the holder's (it runs the session); the press reaches the other replica
    # (Slack spreads interactions too; Discord's come through the leader's gateway), which
    # records the decision and wakes the others; the holder's waiting turn reads it and
    # goes on.
    llm_server.script(
        Reply(tool_calls=[Call("write_marker", {"text": "deploy"}, id="w1")]), Reply("over")
    )
    async with (
        replica("alpha", url, tmp_path, llm_server) as alpha,
        replica("beta", url, tmp_path, llm_server) as beta,
    ):
        await meet(alpha, beta)
        holder, other = (alpha, beta) if alpha.leases.is_home("deploys") else (beta, alpha)
        await holder.chat.deliver(message("please deploy", "c9"))
        async with asyncio.timeout(20):
            card_id, card = await holder.chat.wait_card(lambda c: c.outcome is None)
        assert holder.leases.held() == ["deploys"]
        answer = await other.approvals.press(
            Press("telegram", "c9", APPROVER, card.approval_id, True, card_id)
        )
        assert answer == PressAnswer(True, "Approved.")
        await until(lambda: holder.texts("c9") == ["over"], "the answer after the press")
        assert marker_lines(tmp_path / holder.name / "marker") == ["write_marker:deploy"]
        # The card shows the outcome, edited by the replica whose card it is.
        await until(lambda: holder.chat.cards[card_id].outcome is not None, "the outcome")
        assert other.texts("c9") == []
        request = await holder.app.services.store.get_approval(card.approval_id)
        assert request is not None
        assert (request.status, request.decided_by) == ("approved", APPROVER)


async def test_messages_another_replica_took_in_are_handled_once_as_if_taken_in_here(
    url: str, tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # beta's connection takes these in; alpha holds their session and does with each what
    # it does with its own: a command answered without the model, a refusal of a message too
    # long, a turn.
    llm_server.default = Reply("answered by the holder")
    async with (
        replica("alpha", url, tmp_path, llm_server) as alpha,
        replica("beta", url, tmp_path, llm_server) as beta,
    ):
        await meet(alpha, beta)
        _, c = homed_at(alpha)
        await alpha.chat.deliver(message("hello", c))
        await until(lambda: len(alpha.texts(c)) == 1, "alpha's first answer")
        twice = message("said twice", c)
        for inbound in (message("/help", c), message("x" * 4001, c), twice, twice):
            await beta.chat.deliver(inbound)
        await until(lambda: len(alpha.texts(c)) == 4, "alpha's four answers")
        store = alpha.app.services.store
        await until(lambda: _all_finished(store), "every row finished")
        texts = alpha.texts(c)
        assert texts.count("answered by the holder") == 2
        assert any("/status" in t for t in texts)  # /help, without the model
        assert any("characters long; the limit here is 4,000" in t for t in texts)
        assert beta.texts(c) == []
        assert beta.router.counters["duplicate"] == 1
        # Each row says which replica took it in.
        assert sorted(r.pickup for r in await _inbox(store)) == ["alpha"] + ["beta"] * 3
    assert len(llm_server.requests) == 2


async def test_a_sessions_begun_turn_is_taken_up_before_older_messages(
    url: str, tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # Another replica took an older message in while the session's holder had begun a turn
    # for a newer one, then the holder died: the begun turn is the session's open one and
    # runs first (a later turn would otherwise run its saved tool batch as its own).
    llm_server.script(Reply("first answer"), Reply("second answer"))
    # No pick-up loop of its own (paused=True): the test takes the session up itself.
    async with replica("alpha", url, tmp_path, llm_server, paused=True) as alpha:
        store = alpha.app.services.store
        await store.inbox_add(
            platform="telegram", event_id="e-older", session_id="s1", channel="c1",
            thread=None, user="u1", text="older", message_id="m-older", pickup="beta",
        )  # fmt: skip
        begun, _ = await store.inbox_add(
            platform="telegram", event_id="e-begun", session_id="s1", channel="c1",
            thread=None, user="u1", text="begun", message_id="m-begun", pickup="gone",
        )  # fmt: skip
        await store.inbox_start(begun.id)
        assert await alpha.leases.hold("s1") is not None
        assert await alpha.takeup.take_up("s1") == 2
        await until(lambda: len(alpha.texts("c1")) == 2, "both answers")
        assert [(p.destination.reply_to, p.text) for p in alpha.chat.sent] == [
            ("m-begun", "first answer"),
            ("m-older", "second answer"),
        ]


async def test_a_new_message_waits_for_the_take_up_of_a_session_held_just_now(
    url: str, tmp_path: Path, llm_server: FakeLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pick-up loop has just claimed a session a dead replica left with a begun turn, and
    # its take-up is reading the rows, when a new message of the session comes in here. The
    # new message must not run first: the begun turn would then be started over, its tool
    # run a second time (seen in a chaos run).
    llm_server.script(Reply("first answer"), Reply("second answer"))
    async with replica("alpha", url, tmp_path, llm_server, paused=True) as alpha:
        store = alpha.app.services.store
        begun, _ = await store.inbox_add(
            platform="telegram", event_id="e-begun", session_id="s1", channel="c1",
            thread=None, user="u1", text="begun", message_id="m-begun", pickup="gone",
        )  # fmt: skip
        await store.inbox_start(begun.id)
        read, release = asyncio.Event(), asyncio.Event()
        unfinished = store.inbox_unfinished

        async def slow(*args: Any, **kw: Any) -> Any:
            rows = await unfinished(*args, **kw)
            read.set()
            await release.wait()
            return rows

        monkeypatch.setattr(store, "inbox_unfinished", slow)
        assert await alpha.leases.hold("s1") is not None  # the pick-up loop's claim
        taking = asyncio.create_task(alpha.takeup.take_up("s1"))
        await asyncio.wait_for(read.wait(), 10)
        arrived = message("new", "c1")
        accepted = asyncio.create_task(alpha.chat.deliver(arrived))
        # Admitted (committed and held): queued at once before, waiting for the take-up now.
        await until(lambda: len(alpha.router._held) == 1, "the new message admitted")
        release.set()
        assert await taking == 1
        await accepted
        await until(lambda: len(alpha.texts("c1")) == 2, "both answers")
        assert [(p.destination.reply_to, p.text) for p in alpha.chat.sent] == [
            ("m-begun", "first answer"),
            (arrived.message_id, "second answer"),
        ]


async def test_a_replica_that_stops_renewing_loses_its_sessions_and_what_it_left_is_answered_once(
    url: str, tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # alpha takes s1's message in and runs its turn, which waits on a slow model, and alpha
    # renews nothing meanwhile (as a paused process). beta takes s1 over once the lease's
    # time to live is out and answers the message; alpha's turn, when its model answers, can
    # neither commit nor send anything.
    llm_server.script(Delay(TTL_S * 3, Reply("too late")), Reply("taken over"))
    async with (
        replica("alpha", url, tmp_path, llm_server, paused=True) as alpha,
        replica("beta", url, tmp_path, llm_server) as beta,
    ):
        await alpha.app.services.store.replica_seen("alpha", role="member", host="h", pid=1)
        await meet(beta)
        # In beta's view the session's home is alpha: beta leaves it alone while alpha holds
        # it, and takes it once alpha's lease is out.
        sid, c = next(
            (f"s{n}", f"c{n}") for n in range(1, 5) if beta.leases.home(f"s{n}") == "alpha"
        )
        await alpha.chat.deliver(message("question", c))
        assert alpha.leases.held() == [sid]
        await until(lambda: len(beta.texts(c)) == 1, "beta's answer", timeout=TTL_S * 6)
        assert beta.texts(c) == ["taken over"]
        assert beta.leases.held() == [sid]
        # alpha's turn ends when its model answers: refused, nothing sent.
        await until(lambda: not alpha.router.session_in_use(sid), "alpha's turn", TTL_S * 6)
        assert alpha.texts(c) == []
        store = beta.app.services.store
        await until(lambda: _all_finished(store), "every row finished")
        rows = await store.load_context(sid)
        assert [(r.role, r.turn_id) for r in rows] == [
            ("user", "t-inbox-1"),
            ("assistant", "t-inbox-1"),
        ]
        lease = await store.lease(lease_name(sid))
        assert lease is not None
        assert (lease.holder, lease.epoch) == ("beta", 2)


async def _all_finished(store: Any) -> bool:
    return not await store.inbox_unfinished() and not await store.outbox_pending()


async def _inbox(store: Any) -> list[Any]:
    return [await store.get_inbox(n) for n in range(1, 5)]


async def _leases(url: str) -> list[Any]:
    from geodebot.store.postgres import PostgresStore

    async with PostgresStore(url) as store:
        return list(await store.leases())
