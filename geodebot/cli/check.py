"""``geodebot check``: is this configuration ready to serve? One row per thing it needs.

The configuration loads (or the command already stopped with its errors); each secret it names
is present (its value is never shown); each model answers a model lookup, which spends no
tokens; each enabled platform accepts its token (its identity call); each declared MCP server
starts and offers its declared tools, each with a usable input schema; a local
transcription model ([voice] local_model_dir) is installed and in its directory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from geodebot.app.build import build_adapter, open_mcp_pool
from geodebot.channels.base import ChannelError
from geodebot.config.schema import Config, resolve_secret, secret_names
from geodebot.engine.llm.errors import LLMError

__all__ = ["CheckRow", "format_rows", "run_checks"]

_STEP_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class CheckRow:
    what: str
    ok: bool
    detail: str


@runtime_checkable
class _Probe(Protocol):
    async def probe(self) -> str: ...


async def run_checks(config: Config) -> list[CheckRow]:
    rows = [CheckRow("config", True, str(config.source or "<defaults>"))]
    secrets = {name: resolve_secret(name) for name in sorted(set(secret_names(config)))}
    for name, value in secrets.items():
        detail = "present" if value else "not set (environment or $CREDENTIALS_DIRECTORY)"
        rows.append(CheckRow(f"secret {name}", bool(value), detail))
    for endpoint in [config.model, *config.model.fallbacks]:
        label = f"model {endpoint.provider} {endpoint.name}"
        adapter = build_adapter(endpoint, config)
        try:
            if isinstance(adapter, _Probe):
                rows.append(await _step(label, adapter.probe()))
        finally:
            await adapter.aclose()
    rows += await _channels(config, secrets)
    rows += await _mcp(config)
    rows += _voice(config)
    return rows


def _voice(config: Config) -> list[CheckRow]:
    """A local transcription model: the extra installed, and a model in its directory (it is
    never downloaded)."""
    model_dir = config.voice_model_dir
    if model_dir is None:
        return []
    from geodebot.engine.llm.audio import local_model_problem

    problem = local_model_problem(model_dir)
    return [CheckRow("voice local model", problem is None, problem or f"a model in {model_dir}")]


async def _step(label: str, call: Awaitable[str]) -> CheckRow:
    try:
        async with asyncio.timeout(_STEP_TIMEOUT_S):
            return CheckRow(label, True, await call)
    except (LLMError, ChannelError) as exc:
        return CheckRow(label, False, str(exc))
    except TimeoutError:
        return CheckRow(label, False, f"no answer within {_STEP_TIMEOUT_S:g} s")


async def _channels(config: Config, secrets: dict[str, str | None]) -> list[CheckRow]:
    ch = config.channels
    rows: list[CheckRow] = []
    # The SDKs load only for the platforms this configuration enables.
    if ch.telegram is not None and ch.telegram.enabled:
        from geodebot.channels.identity import telegram_identity

        token = secrets.get(ch.telegram.token_env)
        if token:
            rows.append(await _step("telegram getMe", telegram_identity(ch.telegram, token)))
    if ch.slack is not None and ch.slack.enabled:
        from geodebot.channels.identity import slack_identity

        bot, app = secrets.get(ch.slack.bot_token_env), secrets.get(ch.slack.app_token_env)
        if bot and app:
            rows.append(await _step("slack auth.test", slack_identity(ch.slack, bot, app)))
    if ch.discord is not None and ch.discord.enabled:
        from geodebot.channels.identity import discord_identity

        token = secrets.get(ch.discord.token_env)
        if token:
            rows.append(await _step("discord users/@me", discord_identity(ch.discord, token)))
    return rows


async def _mcp(config: Config) -> list[CheckRow]:
    async with AsyncExitStack() as stack:
        pool = await open_mcp_pool(config, stack)
        if pool is None:
            return []
        from geodebot.engine.mcp.client import MCPServerPool

        assert isinstance(pool, MCPServerPool)
        # Every server, waited for as long as a step may take (not a session's short grace).
        await pool.tool_specs(wait_s=_STEP_TIMEOUT_S)
        rows = []
        for name, state in sorted((await pool.status()).items()):
            unusable = state["unusable"]
            ok = state["state"] == "up" and not unusable
            if state["state"] == "up":
                detail = f"{state['tools']} declared tools offered ({state['transport']})"
                if unusable:
                    detail += "; unavailable: " + "; ".join(
                        f"{tool}: {why}" for tool, why in sorted(unusable.items())
                    )
            else:
                detail = f"{state['state']}: {state['last_error'] or 'did not start'}"
            rows.append(CheckRow(f"mcp {name}", ok, detail))
        return rows


def format_rows(rows: list[CheckRow]) -> str:
    width = max(len(row.what) for row in rows)
    lines = [f"{'check'.ljust(width)}  result  detail"]
    for row in rows:
        lines.append(f"{row.what.ljust(width)}  {'ok  ' if row.ok else 'FAIL'}    {row.detail}")
    return "\n".join(lines)
