"""Per-user flood control: a token bucket per (platform, user).

Each sender may start ``burst`` turns at once and then ``rate_per_min`` a minute. A message
over the limit is *dropped*, not queued: the point is that an abusive flood costs no model
calls, and a queue would only postpone them (and answer stale messages minutes later). The
sender learns of it from one short notice per throttle window, never one per message, so the
notice cannot itself become a flood in the chat.

Buckets live in memory and are forgotten once full again (a full bucket is the same as none),
so idle users cost nothing; a restart forgives everyone, which is harmless.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

# The first throttled message of a window gets the notice; the next ones are silent until
# this long has passed (and the sender is still over the limit).
NOTICE_EVERY_S = 60.0
# Above this many tracked senders, full buckets are swept out on the next check.
_SWEEP_AT = 4096


class Verdict(Enum):
    ALLOW = "allow"
    THROTTLE_NOTICE = "throttle_notice"  # dropped; tell the sender (once per window)
    THROTTLE = "throttle"  # dropped silently; the sender was told already


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float
    noticed_at: float = -math.inf


class UserRateLimiter:
    """``check(platform, user)`` takes a token or says how to drop the message."""

    def __init__(
        self,
        rate_per_min: float,
        burst: int,
        *,
        notice_every_s: float = NOTICE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate_per_min <= 0 or burst < 1:
            raise ValueError("rate_per_min must be > 0 and burst >= 1")
        self._per_s = rate_per_min / 60.0
        self._burst = float(burst)
        self._notice_every_s = notice_every_s
        self._clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def check(self, platform: str, user: str) -> Verdict:
        now = self._clock()
        if len(self._buckets) > _SWEEP_AT:
            self._sweep(now)
        key = (platform, user)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self._burst, now)
        bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.at) * self._per_s)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return Verdict.ALLOW
        if now - bucket.noticed_at >= self._notice_every_s:
            bucket.noticed_at = now
            return Verdict.THROTTLE_NOTICE
        return Verdict.THROTTLE

    def retry_after_s(self, platform: str, user: str) -> float:
        """Seconds until ``user`` may send again (0 when a token is there now)."""
        bucket = self._buckets.get((platform, user))
        if bucket is None:
            return 0.0
        tokens = min(self._burst, bucket.tokens + (self._clock() - bucket.at) * self._per_s)
        return max(0.0, (1.0 - tokens) / self._per_s)

    def tracked(self) -> int:
        return len(self._buckets)

    def _sweep(self, now: float) -> None:
        full = [
            key
            for key, b in self._buckets.items()
            if b.tokens + (now - b.at) * self._per_s >= self._burst
            and now - b.noticed_at >= self._notice_every_s
        ]
        for key in full:
            del self._buckets[key]
