"""What a chaos run does, decided before it starts, all from ``random.Random(seed)``: the
messages (chat, pause before each), the kill points and, with replicas, the pauses.

With replicas the kills and pauses are :class:`ReplicaEvent`: a kill hits one of the replicas
running then, a pause (SIGSTOP) the one serving then, held past the lease's time to live so
another replica takes over. The single daemon's schedule does not depend on the replica
options: the same seed sends the same messages and kills at the same points either way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from tests.support.chaos.world import Chat, chats


@dataclass(frozen=True)
class ChaosPlan:
    seed: int = 1
    messages: int = 120
    kills: int = 6
    chats_per_platform: int = 4
    rate: float = 12.0  # messages per second, on average
    job_every_s: int = 2
    max_kill_delay_s: float = 0.8  # a kill comes this long at most after its message
    max_down_s: float = 0.5  # the daemon stays down this long at most before the restart
    drain_timeout_s: float = 60.0
    settle_s: float = 2.0  # quiet time after the drain, for late duplicates to show
    # 0: one daemon on SQLite. N: N replicas of the daemon on one PostgreSQL database.
    replicas: int = 0
    pauses: int = 0  # SIGSTOPs of the serving replica (replicas only)
    lease_ttl_s: float = 3.0  # the shortest the config allows: takeovers within seconds
    max_pause_extra_s: float = 2.0  # a pause lasts the lease's TTL plus up to this

    def __post_init__(self) -> None:
        if self.pauses and self.replicas < 2:
            raise ValueError("a pause needs a second replica to take over: --replicas 2 or more")

    def line(self) -> str:
        line = f"seed={self.seed} messages={self.messages} kills={self.kills}"
        if self.replicas:
            line += f" replicas={self.replicas} pauses={self.pauses} ttl={self.lease_ttl_s:g}"
        return line


@dataclass(frozen=True)
class Outgoing:
    index: int
    chat: Chat
    pause_s: float  # before sending it


@dataclass(frozen=True)
class KillPoint:
    after_message: int  # once this message (0-based) was sent
    delay_s: float
    down_s: float


@dataclass(frozen=True)
class ReplicaEvent:
    kind: Literal["kill", "pause"]
    after_message: int  # once this message (0-based) was sent
    delay_s: float
    # A kill: how long the replica stays down. A pause: how long past the lease's TTL.
    hold_s: float
    pick: float  # a kill: which of the replicas running then, as a fraction of them


def schedule(plan: ChaosPlan) -> tuple[list[Outgoing], list[KillPoint]]:
    rng = random.Random(plan.seed)
    bound = chats(plan.chats_per_platform)
    outgoing = [
        Outgoing(i, rng.choice(bound), rng.expovariate(plan.rate)) for i in range(plan.messages)
    ]
    kills = [
        KillPoint(after, rng.uniform(0, plan.max_kill_delay_s), rng.uniform(0, plan.max_down_s))
        for after in sorted(_afters(rng, plan.messages, plan.kills))
    ]
    return outgoing, kills


def replica_events(plan: ChaosPlan, kills: list[KillPoint]) -> list[ReplicaEvent]:
    """The kill points as kills of replicas, and the pauses; in the order they come."""
    rng = random.Random(f"replicas-{plan.seed}")
    events = [
        ReplicaEvent("kill", k.after_message, k.delay_s, k.down_s, rng.random()) for k in kills
    ]
    for after in _afters(rng, plan.messages, plan.pauses):
        delay = rng.uniform(0, plan.max_kill_delay_s)
        extra = rng.uniform(0.5, max(0.5, plan.max_pause_extra_s))
        events.append(ReplicaEvent("pause", after, delay, extra, 0.0))
    return sorted(events, key=lambda e: (e.after_message, e.delay_s))


def _afters(rng: random.Random, messages: int, n: int) -> list[int]:
    if n <= messages:
        return rng.sample(range(messages), n)
    return rng.choices(range(messages), k=n)
