"""The chaos run on demand: ``python bench/chaos.py --messages 1000 --kills 30 --seed 7``.

``geodebot serve`` against fake Telegram, Slack and Discord and a fake model, with a scheduled
job, SIGKILLed and restarted at seeded points while messages arrive; then exact counts of
replies, tool effects, job fires and the store's integrity. Exit status 1 if any promise was
broken. The driver is ``tests/support/chaos/driver.py``, shared with ``tests/e2e/test_chaos.py``.

``--replicas 3 --pauses 3``: three daemons on one PostgreSQL database (a throwaway cluster,
durable), one serving under the daemon's lease; the kills hit random replicas, the pauses
SIGSTOP the serving one past its lease's time to live so another takes over.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.chaos.driver import ChaosPlan, run_chaos


def main() -> int:
    defaults = ChaosPlan()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--messages", type=int, default=defaults.messages)
    parser.add_argument("--kills", type=int, default=defaults.kills)
    parser.add_argument("--chats", type=int, default=defaults.chats_per_platform,
                        help="bound chats (sessions) per platform")  # fmt: skip
    parser.add_argument("--rate", type=float, default=defaults.rate,
                        help="messages per second, on average")  # fmt: skip
    parser.add_argument("--job-every", type=int, default=defaults.job_every_s,
                        help="seconds between the job's fires")  # fmt: skip
    parser.add_argument("--replicas", type=int, default=defaults.replicas,
                        help="daemons on one PostgreSQL (0: one daemon on SQLite)")  # fmt: skip
    parser.add_argument("--pauses", type=int, default=defaults.pauses,
                        help="SIGSTOPs of the serving replica past its lease")  # fmt: skip
    parser.add_argument("--lease-ttl", type=float, default=defaults.lease_ttl_s,
                        help="[store] lease_ttl_s of the replicas (3..300)")  # fmt: skip
    parser.add_argument("--drain-timeout", type=float, default=defaults.drain_timeout_s)
    parser.add_argument("--keep", action="store_true", help="keep the state directory")
    args = parser.parse_args()
    if args.pauses and args.replicas < 2:
        parser.error("--pauses needs --replicas 2 or more: another replica takes over")
    plan = ChaosPlan(
        seed=args.seed,
        messages=args.messages,
        kills=args.kills,
        chats_per_platform=args.chats,
        rate=args.rate,
        job_every_s=args.job_every,
        drain_timeout_s=args.drain_timeout,
        replicas=args.replicas,
        pauses=args.pauses,
        lease_ttl_s=args.lease_ttl,
    )
    # A daemon killed mid-request makes the fakes' aiohttp server log "Connection lost" with a
    # traceback: the expected effect of SIGKILL, not a finding.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    workdir = Path(tempfile.mkdtemp(prefix="geodebot-chaos-"))
    began = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - began:7.1f}s] {line}", flush=True)

    try:
        report = asyncio.run(run_chaos(plan, workdir, say=say))
    finally:
        if args.keep:
            print(f"state kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"command: python bench/chaos.py {' '.join(sys.argv[1:])}")
    print(report.summary())
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
