"""Who each platform says the bot is: one identity call per platform, for ``geodebot check``.

Telegram ``getMe``, Slack ``auth.test`` (and ``apps.connections.open`` for the app token,
which only returns a websocket URL that is not dialled), Discord ``GET /users/@me``. Each
answers a short description or raises :class:`ChannelError` with a message that never holds
the token.
"""

from __future__ import annotations

import aiohttp
import telegram.error as tg
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.web.async_client import AsyncWebClient
from telegram import Bot

from geodebot.channels.base import ChannelError
from geodebot.channels.telegram.request import AiohttpRequest
from geodebot.config.schema import DiscordConfig, SlackConfig, TelegramConfig
from geodebot.logs.redact import Redactor

__all__ = ["discord_identity", "slack_identity", "telegram_identity"]

_TIMEOUT_S = 15.0


async def telegram_identity(config: TelegramConfig, token: str) -> str:
    safe = Redactor([token])
    # The daemon's own backend, so the check goes the way the daemon's requests go.
    request = AiohttpRequest(connect_timeout=_TIMEOUT_S, read_timeout=_TIMEOUT_S)
    bot = Bot(token, base_url=config.api_base_url, request=request)
    try:
        me = await bot.get_me()
    except tg.InvalidToken:
        raise ChannelError("telegram: the bot token was rejected", permanent=True) from None
    except tg.TelegramError as exc:
        raise ChannelError(f"telegram: getMe failed: {safe.redact(str(exc))}") from None
    finally:
        await request.shutdown()
    return f"@{me.username} (id {me.id})"


async def slack_identity(config: SlackConfig, bot_token: str, app_token: str) -> str:
    safe = Redactor([bot_token, app_token])
    client = AsyncWebClient(token=bot_token, base_url=config.api_base_url, timeout=int(_TIMEOUT_S))
    try:
        auth = await client.auth_test()
        # Proves the app token and Socket Mode are enabled; the URL it hands out is not used.
        await client.apps_connections_open(app_token=app_token)
    except SlackApiError as exc:
        code = exc.response.get("error") if exc.response is not None else None
        raise ChannelError(f"slack: {code or safe.redact(str(exc))}") from None
    except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
        raise ChannelError(f"slack: {safe.redact(str(exc)) or type(exc).__name__}") from None
    finally:
        if client.session is not None:
            await client.session.close()
    return f"{auth.get('user')} in {auth.get('team')} (bot user {auth.get('user_id')})"


async def discord_identity(config: DiscordConfig, token: str) -> str:
    safe = Redactor([token])
    url = config.api_base_url.rstrip("/") + "/users/@me"
    timeout = aiohttp.ClientTimeout(total=_TIMEOUT_S)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url, headers={"Authorization": f"Bot {token}"}) as response,
        ):
            if response.status == 401:
                raise ChannelError("discord: the bot token was rejected", permanent=True)
            if response.status != 200:
                text = safe.redact(await response.text())[:200]
                raise ChannelError(f"discord: users/@me answered {response.status}: {text}")
            me = await response.json()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ChannelError(f"discord: {safe.redact(str(exc)) or type(exc).__name__}") from None
    return f"{me.get('username')} (id {me.get('id')})"
