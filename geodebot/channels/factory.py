"""Builds the enabled platform channels from the config and keeps them connected.

Each SDK is imported only when its channel is enabled: a daemon that only speaks Telegram
never pays for discord.py or slack_bolt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sys
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping

from geodebot.channels.base import (
    Channel,
    ChannelError,
    CursorStore,
    DeferredIngest,
    InboundSink,
    PressSink,
)
from geodebot.config.schema import (
    TELEGRAM_SECRET,
    Config,
    ConfigError,
    TelegramConfig,
    resolve_secret,
)

log = logging.getLogger(__name__)

# Imported by python-telegram-bot only if installed, for features geodebot never uses:
# cryptography decrypts Telegram Passport data, click and pygments are httpx's command line
# (PTB imports httpx for a backend geodebot replaces). cryptography is installed for mcp,
# the other two for tools; together they are about 9 MB of a daemon's memory.
_PTB_UNUSED_EXTRAS = ("cryptography", "click", "pygments")


@contextlib.contextmanager
def _without(names: tuple[str, ...]) -> Iterator[None]:
    """While inside, importing one of ``names`` fails as if it were not installed (a None
    entry in sys.modules is the import system's own marker for that); a module already
    imported is left alone, and a later import outside works normally."""
    blocked = [name for name in names if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # None is the documented blocker
    try:
        yield
    finally:
        for name in blocked:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def _secret(problems: list[str], key: str, name: str) -> str:
    value = resolve_secret(name)
    if value is None:
        problems.append(
            f"{key}: the environment variable {name} is not set (nor the systemd credential)"
        )
        return ""
    return value


def _webhook_secret(problems: list[str], telegram: TelegramConfig) -> str | None:
    """The webhook's secret token ("" when polling); None (and a problem) if missing or not
    what Telegram accepts."""
    if telegram.webhook_secret_env is None:
        return ""
    key = "channels.telegram.webhook_secret_env"
    value = _secret(problems, key, telegram.webhook_secret_env)
    if not value:
        return None
    if not TELEGRAM_SECRET.fullmatch(value):
        problems.append(
            f"{key}: the secret in {telegram.webhook_secret_env} must be 1 to 256 characters "
            "of A-Z, a-z, 0-9, _ and - (Telegram's rule for secret_token)"
        )
        return None
    return value


def build_channels(
    config: Config,
    store: CursorStore,
    only: Collection[str] | None = None,
    *,
    ingest_later: bool = False,
) -> dict[str, Channel]:
    """One channel per enabled table (of the platforms in ``only``, if given); a missing
    secret is a startup error naming it. ``ingest_later``: each channel's ``start`` leaves
    what only one replica at a time may do (Telegram's poller or setWebhook, Discord's
    gateway) to its ``start_ingest``; Slack's channel takes in from ``start`` regardless."""
    problems: list[str] = []
    channels: dict[str, Channel] = {}
    ch = config.channels
    wanted = set(only) if only is not None else {"telegram", "slack", "discord"}
    if ch.telegram is not None and ch.telegram.enabled and "telegram" in wanted:
        token = _secret(problems, "channels.telegram.token_env", ch.telegram.token_env)
        hook_secret = _webhook_secret(problems, ch.telegram)
        if token and hook_secret is not None:
            with _without(_PTB_UNUSED_EXTRAS):
                from geodebot.channels.telegram import TelegramChannel

            channels["telegram"] = TelegramChannel(
                ch.telegram,
                token,
                cursor_store=store,
                webhook_secret=hook_secret or None,
                ingest_later=ingest_later,
            )
    if ch.slack is not None and ch.slack.enabled and "slack" in wanted:
        bot = _secret(problems, "channels.slack.bot_token_env", ch.slack.bot_token_env)
        app = _secret(problems, "channels.slack.app_token_env", ch.slack.app_token_env)
        if bot and app:
            from geodebot.channels.slack import SlackChannel

            channels["slack"] = SlackChannel(ch.slack, bot_token=bot, app_token=app)
    if ch.discord is not None and ch.discord.enabled and "discord" in wanted:
        token = _secret(problems, "channels.discord.token_env", ch.discord.token_env)
        if token:
            from geodebot.channels.discord import DiscordChannel

            bound = [b.channel for b in config.bindings if b.platform == "discord"]
            channels["discord"] = DiscordChannel(
                ch.discord,
                token,
                bound_channels=bound,
                cursor_store=store,
                ingest_later=ingest_later,
            )
    if problems:
        raise ConfigError(str(config.source or "<config>"), problems)
    for binding in config.bindings:
        if binding.platform not in channels and binding.platform in wanted:
            log.warning(
                "binding %s (%s %s) has no enabled channel; it will not receive messages",
                binding.session,
                binding.platform,
                binding.channel,
            )
    return channels


class ChannelSupervisor:
    """Starts every channel; one that cannot connect is retried with backoff while the
    others run. (Once connected, each SDK keeps its own connection alive.) Channels built
    to take in later are made to by :meth:`start_ingest`, retried the same way.

    ``async with`` it to own the connections: leaving closes them all. Entering connects
    nothing; :meth:`start` does, once whatever must precede the first message is ready.
    """

    def __init__(
        self,
        channels: Mapping[str, Channel],
        sink: InboundSink,
        presses: PressSink | None = None,
    ) -> None:
        self._channels = channels
        self._sink = sink
        self._presses = presses
        self._tasks: list[asyncio.Task[None]] = []
        self.ready: dict[str, asyncio.Event] = {name: asyncio.Event() for name in channels}
        # Set once the channel's start_ingest returned.
        self.ingesting: dict[str, asyncio.Event] = {name: asyncio.Event() for name in channels}
        self._ingest_started = False

    async def __aenter__(self) -> ChannelSupervisor:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self, first_attempt_s: float = 30.0) -> None:
        """Start all channels; returns when each connected or its first attempt timed out."""
        for name, channel in self._channels.items():
            self._tasks.append(asyncio.create_task(self._keep_starting(name, channel)))
        await _first_attempts(self.ready.values(), first_attempt_s)

    async def start_ingest(self, first_attempt_s: float = 30.0) -> None:
        """Make every channel take in (``DeferredIngest.start_ingest``), each once it started;
        returns when each took in or its first attempt timed out, as :meth:`start` does.
        Calls after the first only wait (the first's attempts go on)."""
        if not self._ingest_started:
            self._ingest_started = True
            for name, channel in self._channels.items():
                self._tasks.append(asyncio.create_task(self._keep_ingesting(name, channel)))
        await _first_attempts(self.ingesting.values(), first_attempt_s)

    async def _keep_starting(self, name: str, channel: Channel) -> None:
        await _retried(name, "start", lambda: channel.start(self._sink, self._presses), channel)
        log.info("channel %s connected", name)
        self.ready[name].set()

    async def _keep_ingesting(self, name: str, channel: Channel) -> None:
        await self.ready[name].wait()
        # A channel that cannot be made to take in later took in from its start.
        if isinstance(channel, DeferredIngest):
            # A failed attempt leaves the channel sending: only the taking in is tried again.
            await _retried(name, "take in", channel.start_ingest)
        log.info("channel %s takes in", name)
        self.ingesting[name].set()

    async def stop(self) -> None:
        self._ingest_started = False
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for name, channel in self._channels.items():
            try:
                await channel.stop()
            except Exception:
                log.exception("channel %s did not stop cleanly", name)


async def _first_attempts(events: Iterable[asyncio.Event], first_attempt_s: float) -> None:
    waits = [event.wait() for event in events]
    if waits:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(first_attempt_s):
                await asyncio.gather(*waits)


async def _retried(
    name: str,
    what: str,
    attempt: Callable[[], Awaitable[None]],
    stop_after_failure: Channel | None = None,
) -> None:
    """``attempt()`` until it returns, with growing pauses (and ``stop_after_failure``
    stopped after each failure, so the next attempt starts clean)."""
    delay = 1.0
    while True:
        try:
            await attempt()
        except Exception as exc:
            # A ChannelError already says what went wrong; anything else is a bug to trace.
            expected = isinstance(exc, ChannelError)
            log.error(
                "channel %s could not %s%s; retrying in %.0f s",
                name,
                what,
                f": {exc}" if expected else "",
                delay,
                exc_info=not expected,
            )
            if stop_after_failure is not None:
                with contextlib.suppress(Exception):
                    await stop_after_failure.stop()
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, 300.0)
            continue
        return
