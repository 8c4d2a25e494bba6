"""Health and metrics over HTTP: ``/healthz`` (JSON per component), ``/livez`` and
``/metrics`` (Prometheus text format), on ``[daemon] http``.

``/healthz`` is for alerts and readiness: it is unhealthy while anything needs an operator (a
platform down, a message unanswered, a daemon-wide budget spent), none of which a restart
mends. ``/livez`` is for liveness probes: it answers while the daemon's event loop runs and
the store can be read, which is what a restart can bring back.

Metrics live in a registry of the daemon's own, never the process-global default one. Engine
events (turns, model calls, tool calls) arrive through the engine's observer hook; the
channels' and router's counters are read when Prometheus scrapes, so the hot path pays
nothing for them. The operator's Work console (ops/console/) adds its routes to the same app;
these two keep their own bearer-header check. :func:`health_server` builds it all for the
running daemon, from the :class:`~geodebot.ops.status.Serving` view the composition root
hands in (:func:`daemon_probe` says what each component reads).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, get_args

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from geodebot.channels.base import Channel
from geodebot.config.schema import ConfigError, PairingConfig, resolve_secret, split_host_port
from geodebot.engine.session import COMPUTER_USE_SWITCH
from geodebot.engine.tools.runner import REASON_CODES, OutcomeStatus
from geodebot.ops.status import Serving, unanswered
from geodebot.store.protocol import Store

if TYPE_CHECKING:
    from geodebot.ops.console.live import LiveFeed

log = logging.getLogger(__name__)

__all__ = [
    "HEALTH_PATHS",
    "ConsoleRoutes",
    "EngineMetrics",
    "HealthServer",
    "Probe",
    "daemon_probe",
    "health_server",
    "replica_component",
]

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
_STORE_TIMEOUT_S = 2.0
# The health server's own routes: with the console on they keep their bearer-header check.
HEALTH_PATHS = frozenset({"/healthz", "/livez", "/metrics"})


# Label values come only from closed sets: a model chooses the tool names it proposes (and a
# refused call's name is whatever it sent), and every distinct label value is a series kept
# for the life of the process.
OTHER = "other"
_TOOL_STATUSES = frozenset(get_args(OutcomeStatus))


class EngineMetrics:
    """An engine observer: counts turns, model calls and tool calls into ``registry``.

    ``known_tools`` are the tool names a plan can hold (set by the composition root once the
    registry is built); any other proposed name is counted as ``other``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.known_tools: frozenset[str] = frozenset()
        self.registry = registry = registry if registry is not None else CollectorRegistry()
        self.turns = Counter(
            "geodebot_turns", "Turns finished, by outcome.", ["outcome"], registry=registry
        )
        self.model_latency = Histogram(
            "geodebot_model_latency_seconds",
            "Latency of successful model calls.",
            ["provider", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.model_tokens = Counter(
            "geodebot_model_tokens",
            "Tokens of successful model calls: input (all of it), output, and of the input "
            "what the prompt cache served (cache_read) and stored (cache_write).",
            ["provider", "model", "direction"],
            registry=registry,
        )
        self.model_errors = Counter(
            "geodebot_model_errors", "Failed model calls, by kind.", ["kind"], registry=registry
        )
        self.tool_calls = Counter(
            "geodebot_tool_calls",
            "Tool calls, by tool, status and refusal or error reason.",
            ["tool", "status", "reason"],
            registry=registry,
        )
        self.last_model_ok: float | None = None
        self.last_model_error: tuple[float, str] | None = None

    def __call__(self, event: str, data: Mapping[str, Any]) -> None:
        if event == "turn_finished":
            self.turns.labels(str(data.get("outcome", ""))).inc()
        elif event == "llm_call":
            provider, model = str(data.get("provider", "")), str(data.get("model", ""))
            self.model_latency.labels(provider, model).observe(
                float(data.get("latency_ms", 0)) / 1000
            )
            tokens = self.model_tokens
            tokens.labels(provider, model, "input").inc(int(data.get("input_tokens", 0)))
            tokens.labels(provider, model, "output").inc(int(data.get("output_tokens", 0)))
            # Of the input, what the provider's prompt cache served and what it stored.
            for direction in ("cache_read", "cache_write"):
                count = int(data.get(f"{direction}_tokens", 0))
                tokens.labels(provider, model, direction).inc(count)
            self.last_model_ok = time.time()
        elif event == "llm_error":
            kind = str(data.get("kind", ""))
            self.model_errors.labels(kind).inc()
            self.last_model_error = (time.time(), kind)
        elif event == "tool_call":
            tool, status = str(data.get("tool", "")), str(data.get("status", ""))
            reason = data.get("reason")
            self.tool_calls.labels(
                tool if tool in self.known_tools else OTHER,
                status if status in _TOOL_STATUSES else OTHER,
                "" if reason is None else reason if reason in REASON_CODES else OTHER,
            ).inc()


class ConsoleRoutes(Protocol):
    """What adds the Work console (ops/console/) to the server's app."""

    def install(self, app: web.Application, own_paths: frozenset[str] = ...) -> None: ...


@dataclass
class Probe:
    """What the endpoint reads of the running daemon; set as the parts come up."""

    store: Store
    channels: Mapping[str, Channel] = field(default_factory=dict)
    router_counters: Callable[[], Mapping[str, int]] = dict
    load: Callable[[], tuple[int, int]] = lambda: (0, 0)
    # Job fires by outcome (over all history), when the daemon runs a scheduler.
    fire_counts: Callable[[], Awaitable[Mapping[str, int]]] | None = None
    # Accepted messages without a reply for longer than the alert, when the daemon says.
    unanswered: Callable[[], Awaitable[int]] | None = None
    # Streams of live updates open now (the console's /events: one per browser).
    live_clients: Callable[[], int] | None = None
    # The daemon's lease, when replicas share the store (replicas/daemon_lease.py figures()).
    lease: Callable[[], Mapping[str, Any]] | None = None
    # name -> (ok, detail) for further components (scheduler, computer use, ...).
    extra: dict[str, Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]] = field(
        default_factory=dict
    )


class _LiveCollector(Collector):
    """Counters and gauges read from the daemon's own state at scrape time."""

    def __init__(self, probe: Probe) -> None:
        self._probe = probe
        self.outbox: Mapping[str, int] = {}
        self.fires: Mapping[str, int] = {}
        self.unanswered: int | None = None

    def collect(self) -> Iterator[Any]:
        messages = CounterMetricFamily(
            "geodebot_messages",
            "Chat messages seen by the router: received, accepted, duplicate, busy, too_large, "
            "throttled, throttle_notices, dropped:<reason>.",
            labels=["event"],
        )
        for event, count in sorted(self._probe.router_counters().items()):
            messages.add_metric([event], count)
        yield messages
        channel_events = CounterMetricFamily(
            "geodebot_channel_events",
            "Per-platform adapter counters.",
            labels=["platform", "event"],
        )
        connected = GaugeMetricFamily(
            "geodebot_channel_connected",
            "1 when the platform connection is up.",
            labels=["platform"],
        )
        for name, channel in sorted(self._probe.channels.items()):
            status = channel.status()
            connected.add_metric([name], 1.0 if status.connected else 0.0)
            for event, count in sorted(status.counters.items()):
                channel_events.add_metric([name, event], count)
        yield channel_events
        yield connected
        running, queued = self._probe.load()
        yield GaugeMetricFamily("geodebot_turns_running", "Turns running now.", value=running)
        yield GaugeMetricFamily(
            "geodebot_queue_depth", "Messages waiting behind running turns.", value=queued
        )
        outbox = GaugeMetricFamily(
            "geodebot_outbox_rows", "Outbox rows by status.", labels=["status"]
        )
        for row_status, count in sorted(self.outbox.items()):
            outbox.add_metric([row_status], count)
        yield outbox
        fires = CounterMetricFamily(
            "geodebot_job_fires", "Scheduled job fires, by outcome.", labels=["outcome"]
        )
        for outcome, count in sorted(self.fires.items()):
            fires.add_metric([outcome], count)
        yield fires
        if self.unanswered is not None:
            yield GaugeMetricFamily(
                "geodebot_unanswered_messages",
                "Accepted messages still without a reply after [daemon] unanswered_alert_s.",
                value=self.unanswered,
            )
        if self._probe.lease is not None:
            lease = self._probe.lease()
            yield GaugeMetricFamily(
                "geodebot_replica_leading",
                "1 while this replica holds the daemon's lease (Telegram's poller, Discord's "
                "gateway, the scheduler), else 0.",
                value=1 if lease.get("leading") else 0,
            )
            yield CounterMetricFamily(
                "geodebot_lease_takeovers",
                "Changes of the daemon lease's holder since the database began (its epoch - 1).",
                value=lease.get("takeovers") or 0,
            )
        if self._probe.live_clients is not None:
            yield GaugeMetricFamily(
                "geodebot_console_live_clients",
                "Streams of the console's live updates open now (all tabs of a browser share one).",
                value=self._probe.live_clients(),
            )


class HealthServer:
    def __init__(
        self,
        address: str,
        probe: Probe,
        metrics: EngineMetrics,
        *,
        token: str | None = None,
        console: ConsoleRoutes | None = None,
    ) -> None:
        self._host, self._port = split_host_port(address)
        self._console = console
        self._probe = probe
        self._registry = registry = metrics.registry
        self._metrics = metrics
        self._token = token
        self._live = _LiveCollector(probe)
        registry.register(self._live)
        ProcessCollector(registry=registry)
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> HealthServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/metrics", self._scrape)
        if self._console is not None:
            self._console.install(app, HEALTH_PATHS)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port)
        await site.start()
        self._runner = runner
        # Port 0 asks for a free one; the bound address says which.
        self.port = int(runner.addresses[0][1]) if runner.addresses else self._port
        log.info("health and metrics on http://%s:%s/", self._host, self.port)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        # With the console on, its own checks guard every other path (a token cookie counts
        # there, and a browser is asked for the token); these two keep the bearer header.
        guarded = self._console is None or request.path in HEALTH_PATHS
        if self._token is not None and guarded:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ")
            # aiohttp keeps undecodable header bytes as surrogates; they must compare (and
            # fail) like any other wrong token, not raise.
            if not hmac.compare_digest(
                given.encode("utf-8", "surrogateescape"), self._token.encode()
            ):
                return web.json_response({"error": "unauthorized"}, status=401)
        return await handler(request)

    async def health(self) -> tuple[bool, dict[str, Any]]:
        components: dict[str, Any] = {}
        healthy = True
        try:
            async with asyncio.timeout(_STORE_TIMEOUT_S):
                version = await self._probe.store.schema_version()
            components["store"] = {"ok": True, "schema_version": version}
        except Exception as exc:  # noqa: BLE001 - any failure is the answer: unhealthy
            components["store"] = {"ok": False, "error": str(exc)[:300]}
            healthy = False
        channels: dict[str, Any] = {}
        for name, channel in sorted(self._probe.channels.items()):
            status = channel.status()
            channels[name] = {"ok": status.connected, "detail": status.detail}
            healthy = healthy and status.connected
        components["channels"] = channels
        m = self._metrics
        components["model"] = {
            "last_ok": m.last_model_ok,
            "last_error": None
            if m.last_model_error is None
            else {"at": m.last_model_error[0], "kind": m.last_model_error[1]},
        }
        for name, check in sorted(self._probe.extra.items()):
            try:
                ok, detail = await check()
            except Exception as exc:  # noqa: BLE001 - a failing check is an unhealthy part
                ok, detail = False, {"error": str(exc)[:300]}
            components[name] = {"ok": ok, **detail}
            healthy = healthy and ok
        running, queued = self._probe.load()
        components["turns"] = {"running": running, "queued": queued}
        return healthy, components

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        healthy, components = await self.health()
        body = {"status": "ok" if healthy else "unhealthy", "components": components}
        return web.json_response(body, status=200 if healthy else 503)

    async def _livez(self, request: web.Request) -> web.StreamResponse:
        try:
            async with asyncio.timeout(_STORE_TIMEOUT_S):
                await self._probe.store.schema_version()
        except Exception as exc:  # noqa: BLE001 - any failure is the answer: not alive
            return web.json_response({"status": "dead", "store": str(exc)[:300]}, status=503)
        return web.json_response({"status": "ok"})

    async def _scrape(self, request: web.Request) -> web.StreamResponse:
        try:
            self._live.outbox = await self._probe.store.outbox_counts()
            if self._probe.fire_counts is not None:
                self._live.fires = await self._probe.fire_counts()
            if self._probe.unanswered is not None:
                self._live.unanswered = await self._probe.unanswered()
        except Exception:
            log.warning(
                "metrics: cannot count outbox rows, job fires or unanswered messages",
                exc_info=True,
            )
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# -- the daemon's probes ------------------------------------------------------------------

Check = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]


def replica_component(serving: Serving) -> Check:
    """/healthz's ``replica``: this process and its store, and, with replicas, the daemon's
    lease, the sessions held and the peers (unhealthy once the daemon's lease was lost: the
    replica stops)."""
    replica = {"id": serving.replica_id, "store": dict(serving.store_facts)}
    shared = serving.replicas

    async def component() -> tuple[bool, dict[str, Any]]:
        if shared is None:
            return True, replica
        return shared.lost is None, {
            **replica,
            "lease": shared.lease_figures(),
            "sessions": shared.session_figures(),
            "peers": await shared.peers(),
        }

    return component


def daemon_probe(serving: Serving, live_clients: Callable[[], int] | None = None) -> Probe:
    """What ``/healthz`` and ``/metrics`` read of the running daemon: the store, the
    channels, the router's load, the scheduler, computer use, unanswered messages, the
    replica and its leases, and the day's budgets when the daemon keeps any."""
    store = serving.services.store

    async def computer_use() -> tuple[bool, dict[str, Any]]:
        switch = await store.get_switch(COMPUTER_USE_SWITCH)
        if switch is None:
            return True, {"enabled": False}
        return True, {
            "enabled": switch.active(time.time()),
            "set_by": switch.set_by,
            "set_at": switch.set_at,
            "expires_at": switch.expires_at,
            "reason": switch.reason,
        }

    scheduler, router = serving.scheduler, serving.router

    async def jobs() -> tuple[bool, dict[str, Any]]:
        return scheduler.running, {"jobs": scheduler.registered()}

    alert_s = serving.config.daemon.unanswered_alert_s

    async def late() -> tuple[bool, dict[str, Any]]:
        found = await unanswered(store, alert_s)
        return found["count"] == 0, found

    async def unanswered_count() -> int:
        return (await store.inbox_unanswered(alert_s)).count

    replicas = serving.replicas
    probe = Probe(
        store,
        serving.channels,
        router_counters=lambda: router.counters,
        load=router.load,
        fire_counts=store.fire_counts,
        extra={
            "computer_use": computer_use,
            "scheduler": jobs,
            "unanswered": late,
            "replica": replica_component(serving),
        },
        unanswered=unanswered_count,
        live_clients=live_clients,
        lease=replicas.lease_figures if replicas is not None else None,
    )
    spend = serving.services.spend
    if spend is not None:
        probe.extra["budgets"] = spend.status
    return probe


def _pairing_in_force(serving: Serving) -> Callable[[], PairingConfig] | None:
    in_force = serving.in_force
    if in_force is None:
        return None
    return lambda: in_force.config.pairing


def health_server(serving: Serving, metrics: EngineMetrics, live: LiveFeed) -> HealthServer:
    """The endpoint on ``[daemon] http``: health, metrics and the Work console. A token named
    by ``[daemon] http_token_env`` guards it; one named but not set is a config error."""
    from geodebot.ops.console.parts import ConsoleParts
    from geodebot.ops.console.server import Console

    config = serving.config
    assert config.daemon.http is not None
    token = None
    if config.daemon.http_token_env:
        token = resolve_secret(config.daemon.http_token_env)
        if not token:
            source = str(config.source or "<config>")
            name = config.daemon.http_token_env
            raise ConfigError(source, [f"daemon.http_token_env: {name} is not set"])
    spend = serving.services.spend
    console = Console(
        ConsoleParts(
            serving.services.store,
            config,
            serving.bindings,
            serving.services.tools.registry,
            live,
            approvals=serving.approvals,
            spend_status=spend.status if spend is not None else None,
            relay=serving.relay,
            deadletters=serving.deadletters,
            ledger=serving.services.ledger,
            refresh_bindings=serving.stored.refresh if serving.stored is not None else None,
            pairing_config=_pairing_in_force(serving),
        ),
        token=token,
        bound_host=split_host_port(config.daemon.http)[0],
        public_origin=config.daemon.console_url,
    )
    probe = daemon_probe(serving, lambda: live.clients)
    return HealthServer(config.daemon.http, probe, metrics, token=token, console=console)
