"""``geodebot usage``: what the model calls used and cost, straight from the store.

Every model call is a row (see ``store/spend.py``): its tokens as the provider
reported them, the part of its input the prompt cache served or stored, and its cost at the
configured prices. Totals here are sums of those rows, grouped by binding, job or UTC day.
A call a crash left reserved is reported apart, at the worst case its budgets still count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from geodebot.app.store import opened_store
from geodebot.config.schema import Config
from geodebot.store.records import UsageRow

__all__ = ["add_usage_parser", "usage_command"]

EXIT_OK = 0


def add_usage_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    usage = sub.add_parser(
        "usage", parents=[common], help="tokens, prompt-cache hits and cost of the model calls"
    )
    usage.add_argument(
        "--by", choices=("binding", "job", "day"), default=None, help="one line per group"
    )
    usage.add_argument("--since", metavar="YYYY-MM-DD", help="only calls from this UTC day on")
    usage.add_argument("--json", action="store_true", help="one JSON object per line")


async def usage_command(config: Config, args: argparse.Namespace) -> int:
    async with opened_store(config) as store:
        rows = await store.usage_report(by=args.by or "all", since_day=args.since)
    if args.json:
        for row in rows:
            print(json.dumps(_shown(row), sort_keys=True))
        return EXIT_OK
    if not rows:
        print("no model calls")
        return EXIT_OK
    header = f"{(args.by or '').upper() or 'ALL':<28} {'CALLS':>7} {'INPUT':>12} {'OUTPUT':>10}"
    print(f"{header} {'CACHE READ':>12} {'CACHE WRITE':>12} {'HIT':>5} {'COST USD':>11}")
    for row in rows:
        hit = f"{row.cache_read_tokens / row.input_tokens:.0%}" if row.input_tokens else "-"
        cost = f"{row.cost_usd:.4f}" + ("*" if row.unpriced else "")
        print(
            f"{row.key[:28]:<28} {row.calls:>7} {row.input_tokens:>12,} {row.output_tokens:>10,} "
            f"{row.cache_read_tokens:>12,} {row.cache_write_tokens:>12,} {hit:>5} {cost:>11}"
        )
        if row.unsettled:
            print(
                f"{'':<28} {row.unsettled} call(s) cut off before settling, counted in their "
                f"budgets at their worst case: {row.unsettled_tokens:,} tokens"
            )
        if row.audio_seconds or row.spoken_chars:
            print(
                f"{'':<28} audio: {row.audio_seconds / 60:,.1f} min transcribed, "
                f"{row.spoken_chars:,} characters spoken"
            )
    if any(row.unpriced for row in rows):
        print(
            "* some calls are of a model without [model] price_per_mtok (or of an audio "
            "service without [voice] prices): not in the cost"
        )
    return EXIT_OK


def _shown(row: UsageRow) -> dict[str, Any]:
    return dataclasses.asdict(row)
