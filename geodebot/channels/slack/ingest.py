"""Slack's events in, over Socket Mode: the connection, the listeners, the hand-over to the
sink, and the acknowledgement after it.

Acknowledgement: Bolt runs with ``process_before_response=True``, so the envelope is acked only
after our listener returned, i.e. after the sink committed the event. A sink that raises makes
the listener raise; Bolt turns that into a 500 and its Socket Mode handler sends no ack, so
Slack delivers the event again (``retry_attempt`` > 0, same ``event_id``). Dropping repeats of
one event id is the daemon's job.

``message`` and ``app_mention``: a mention in a channel the bot is in arrives twice, as two
events with different ids but the same (channel, ts). Both are listened to (a workspace may
subscribe to only one of them); the first event to claim a message delivers it and the other
is acked and dropped. A claim is released when the sink fails, so a redelivery can still win.
The claims live in memory: a restart between the two events can let both through.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import aiohttp
from slack_bolt.adapter.socket_mode.async_handler import AsyncSocketModeHandler
from slack_bolt.async_app import AsyncAck, AsyncApp
from slack_sdk.errors import SlackClientError
from slack_sdk.web.async_client import AsyncWebClient

from geodebot.channels.base import ChannelError, InboundSink, PressSink
from geodebot.channels.slack.cards import APPROVE_ACTION, DENY_ACTION
from geodebot.channels.slack.inbound import command_to_inbound, to_inbound
from geodebot.channels.slack.send import to_channel_error
from geodebot.channels.slack.state import SlackState

# One logger for the whole adapter, under the name its operators know it by.
log = logging.getLogger("geodebot.channels.slack")

_CLAIMS_KEPT = 4096


class SlackIngest:
    """The Socket Mode connection and what arrives over it; ``on_press`` answers a button
    press that was already acked."""

    def __init__(
        self,
        state: SlackState,
        *,
        on_press: Callable[[dict[str, Any]], None],
        ping_interval_s: float,
        connect_timeout_s: float,
        stop_grace_s: float,
    ) -> None:
        self._state = state
        self._on_press = on_press
        self._ping_interval = ping_interval_s
        self._connect_timeout = connect_timeout_s
        self._stop_grace = stop_grace_s
        self._handler: AsyncSocketModeHandler | None = None
        self._sink: InboundSink | None = None
        self._claims: OrderedDict[tuple[str, str], str] = OrderedDict()

    @property
    def ingesting(self) -> bool:
        """Whenever started: Slack spreads events over every replica's connection."""
        return self._handler is not None

    @property
    def connected(self) -> bool:
        sm = self._handler.client if self._handler is not None else None
        ws = sm.current_session if sm is not None else None
        return sm is not None and not sm.closed and ws is not None and not ws.closed

    async def start(self, sink: InboundSink, presses: PressSink | None) -> None:
        if self._handler is not None:
            raise RuntimeError("SlackChannel already started")
        self._sink = sink
        self._state.presses = presses
        self._state.stopping = False
        # Both SDK clients need a running loop at construction (aiohttp sessions, and the
        # Socket Mode client starts its message processor task in __init__).
        client = self._state.open_client()
        try:
            auth = await client.auth_test()
            self._state.bot_user_id = str(auth.get("user_id") or "")
            self._state.bot_id = auth.get("bot_id")
            self._handler = AsyncSocketModeHandler(
                self._build_app(client), self._state.app_token, ping_interval=self._ping_interval
            )
            # Asking for the URL ourselves turns a bad app token into an error here; the SDK's
            # connect() would retry it forever.
            self._handler.client.wss_uri = await self._handler.client.issue_new_wss_url()
            async with asyncio.timeout(self._connect_timeout):
                await self._handler.connect_async()  # type: ignore[no-untyped-call]  # slack-bolt
        except BaseException as exc:
            await self._close()
            if isinstance(exc, TimeoutError):
                raise ChannelError("Slack: Socket Mode did not connect in time") from exc
            if isinstance(exc, SlackClientError | aiohttp.ClientError):
                raise to_channel_error(exc, "start") from exc
            raise
        log.info("slack: connected as %s", self._state.bot_user_id)

    def _build_app(self, client: AsyncWebClient) -> AsyncApp:
        app = AsyncApp(
            name="geodebot.slack",
            client=client,  # carries the bot token; passing token= too only earns a warning
            process_before_response=True,
            # Socket Mode has no signatures, url_verification or ssl_check requests.
            request_verification_enabled=False,
            url_verification_enabled=False,
            ssl_check_enabled=False,
            attaching_function_token_enabled=False,
            attaching_conversation_kwargs_enabled=False,
        )

        async def on_message(body: dict[str, Any]) -> None:
            await self._deliver(body)

        async def on_command(ack: AsyncAck, body: dict[str, Any]) -> None:
            # Acked only once committed; a failed commit shows the user Slack's own error.
            await self._deliver_command(body)
            await ack()

        async def on_press(ack: AsyncAck, body: dict[str, Any]) -> None:
            # Acked before deciding: Slack never redelivers an interaction, and the presser
            # gets an answer either way (see SlackCards._answer_press).
            await ack()
            self._on_press(body)

        async def on_other(body: dict[str, Any]) -> None:
            # An unhandled event is answered 404 by Bolt, i.e. never acked and redelivered.
            self._state.counters["ignored"] += 1

        async def on_error(error: Exception, body: dict[str, Any]) -> None:
            # A failed commit, or a payload Bolt itself cannot read (Slack gives up on those
            # after its three retries).
            self._state.counters["errors"] += 1
            event_id = body.get("event_id") if isinstance(body, dict) else None
            log.warning(
                "slack: event %s not acknowledged, Slack will redeliver: %r", event_id, error
            )

        app.event("message")(on_message)
        app.event("app_mention")(on_message)
        app.event(re.compile(".*"))(on_other)
        app.command(re.compile(".*"))(on_command)
        for action_id in (APPROVE_ACTION, DENY_ACTION):
            app.action({"type": "block_actions", "action_id": action_id})(on_press)
        app.error(on_error)
        return app

    async def _deliver(self, body: dict[str, Any]) -> None:
        self._state.counters["received"] += 1
        if self._state.stopping or self._sink is None:
            # Raising (not returning) keeps Bolt from acking what was never committed.
            raise ChannelError("Slack channel is stopping")
        inbound = to_inbound(body, self._state.bot_user_id, self._state.bot_id)
        if inbound is None:
            self._state.counters["ignored"] += 1
            return
        key = (inbound.channel, inbound.message_id)
        owner = self._claims.get(key)
        if owner is not None and owner != inbound.event_id:
            self._state.counters["duplicates"] += 1
            return
        self._claims[key] = inbound.event_id
        self._claims.move_to_end(key)
        while len(self._claims) > _CLAIMS_KEPT:
            self._claims.popitem(last=False)
        task = asyncio.current_task()
        assert task is not None
        self._state.inflight.add(task)
        try:
            await self._sink(inbound)
        except BaseException:
            if self._claims.get(key) == inbound.event_id:
                del self._claims[key]
            self._state.counters["sink_errors"] += 1
            raise
        finally:
            self._state.inflight.discard(task)
        self._state.counters["delivered"] += 1

    async def _deliver_command(self, body: dict[str, Any]) -> None:
        self._state.counters["received"] += 1
        if self._state.stopping or self._sink is None:
            raise ChannelError("Slack channel is stopping")
        inbound = command_to_inbound(body)
        if inbound is None:
            self._state.counters["ignored"] += 1
            return
        try:
            await self._sink(inbound)
        except BaseException:
            self._state.counters["sink_errors"] += 1
            raise
        self._state.counters["delivered"] += 1

    async def stop(self) -> None:
        # In-flight sink calls get a moment to commit and be acked over the still-open socket;
        # whatever is cut off is not acked and comes again after a restart.
        self._state.stopping = True
        if self._state.inflight:
            await asyncio.wait(set(self._state.inflight), timeout=self._stop_grace)
        late = set(self._state.inflight)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        await self._close()

    async def _close(self) -> None:
        handler, self._handler = self._handler, None
        if handler is not None:
            await handler.close_async()  # type: ignore[no-untyped-call]  # slack-bolt lacks a hint
            sm = handler.client
            # close() only cancels the client's tasks; awaiting them keeps teardown quiet.
            tasks = [t for t in (sm.message_processor, sm.current_session_monitor) if t]
            if sm.message_receiver is not None:
                tasks.append(sm.message_receiver)
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._state.close_client()
