"""The SDK floor: a process that imports what geodebot's daemon imports from its SDKs with
Telegram, Slack and Discord enabled and the Anthropic model (the modules geodebot's own code
imports from each, the adapters' and the scheduler's), and nothing of geodebot.

Its RSS is the least any daemon built on these SDKs occupies, whatever it does; geodebot's
idle RSS minus this, measured in the same run, is what geodebot's own code and state cost
(``bench/telegram_bench.py``). It prints ``ready`` once imported, then waits for its stdin to
close.
"""

from __future__ import annotations

import asyncio  # noqa: F401
import gc
import sqlite3  # noqa: F401
import sys

import aiohttp  # noqa: F401
import aiosqlite  # noqa: F401
import anthropic  # noqa: F401
import apscheduler.jobstores.memory
import apscheduler.schedulers.asyncio
import apscheduler.triggers.cron
import apscheduler.triggers.date
import apscheduler.triggers.interval  # noqa: F401
import discord  # noqa: F401
import pydantic  # noqa: F401
import slack_bolt.adapter.socket_mode.async_handler
import slack_bolt.async_app  # noqa: F401
import slack_sdk.errors
import slack_sdk.web.async_client  # noqa: F401
import telegram
import telegram.error
import telegram.request  # noqa: F401

if __name__ == "__main__":
    gc.collect()
    print(f"ready {len(sys.modules)}", flush=True)
    sys.stdin.read()
