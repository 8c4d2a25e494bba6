"""The composition root: everything is built here once and passed down.

No other module constructs shared services or keeps module-level state; the CLI asks this
module for an :class:`App` and drives it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack, aclosing, closing
from dataclasses import dataclass
from typing import Any

from geodebot.app.secrets import build_redactor
from geodebot.app.store import make_store, replica_id
from geodebot.chat.bindings import BindingIndex, binding_key
from geodebot.chat.send_file import send_file_spec
from geodebot.config.schema import Config, ConfigError, ModelEndpoint, resolve_secret
from geodebot.engine.attachments import FileView
from geodebot.engine.context_cache import ContextCache
from geodebot.engine.hooks import HookRegistry, hooks_from_config, hooks_from_entry_points
from geodebot.engine.lanes import Lanes
from geodebot.engine.ledger import EvidenceLedger
from geodebot.engine.llm.deferred import DeferredAdapter
from geodebot.engine.llm.resilient import ResilientLLM
from geodebot.engine.llm.types import Block, LLMAdapter
from geodebot.engine.loop import AgenticLoop
from geodebot.engine.mcp.trust import TrustStore, load_project_servers
from geodebot.engine.modes import Mode
from geodebot.engine.session import (
    EngineServices,
    ModelLimits,
    Observer,
    SessionSpec,
    TurnEnding,
    TurnResult,
    create_session,
)
from geodebot.engine.spend import SpendGate, SpendLimits
from geodebot.engine.tools.authority import ToolAuthority
from geodebot.engine.tools.builtin import BuiltinSettings, builtin_tools
from geodebot.engine.tools.builtin.paths import ensure_workspace
from geodebot.engine.tools.catalog import ToolCatalog, ToolSource
from geodebot.engine.tools.plan import allowlist_problems
from geodebot.engine.tools.registry import ToolRegistry
from geodebot.engine.verify import NonEmptyAnswer, Verifier
from geodebot.memory.tools import MemoryTools
from geodebot.relay.tools import ThreadRelay
from geodebot.scheduler.chat_tools import JobTools
from geodebot.scheduler.definitions import check_jobs
from geodebot.store.files import FileStore

log = logging.getLogger(__name__)

MCP_PREFIX = "mcp__"


def load_system_prompt(config: Config) -> str:
    parts: list[str] = []
    problems: list[str] = []
    for index, source in enumerate(config.prompt.sources):
        if source.text is not None:
            parts.append(source.text.strip())
            continue
        assert source.file is not None
        path = config.prompt_file(source.file)
        try:
            parts.append(path.read_text(encoding="utf-8").strip())
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            problems.append(f"prompt.sources.{index}.file: cannot read {path}: {reason}")
    if problems:
        raise ConfigError(str(config.source or "<config>"), problems)
    return "\n\n".join(p for p in parts if p)


def build_adapter(endpoint: ModelEndpoint, config: Config) -> LLMAdapter:
    key = resolve_secret(endpoint.key_env)
    common: dict[str, Any] = {
        "model": endpoint.name,
        "api_key": key,
        "api_key_env": endpoint.key_env,
        "base_url": endpoint.base_url,
        "timeout_s": config.model.request_timeout_s,
    }
    # The SDKs are imported only for the providers configured: importing the anthropic SDK
    # alone costs seconds, which every CLI command and every daemon start would pay.
    if endpoint.provider == "anthropic":
        from geodebot.engine.llm.anthropic_adapter import AnthropicAdapter

        return AnthropicAdapter(**common, prompt_cache=config.model.prompt_cache)
    from geodebot.engine.llm.openai_adapter import OpenAIAdapter

    return OpenAIAdapter(provider=endpoint.provider, **common)


def build_deferred_adapter(endpoint: ModelEndpoint, config: Config) -> DeferredAdapter:
    """``build_adapter`` once the provider's SDK has been imported on a worker thread."""
    module = "anthropic_adapter" if endpoint.provider == "anthropic" else "openai_adapter"
    return DeferredAdapter(
        endpoint.provider,
        endpoint.name,
        f"geodebot.engine.llm.{module}",
        lambda: build_adapter(endpoint, config),
    )


def spend_limits(config: Config) -> SpendLimits:
    return SpendLimits(
        daily_tokens=config.budgets.daily_tokens,
        daily_usd=config.model.daily_usd,
        bindings={binding_key(b): b.daily_tokens for b in config.bindings if b.daily_tokens},
        jobs={j.id: j.max_tokens_per_run for j in config.jobs if j.max_tokens_per_run},
        prices={
            (e.provider, e.name): e.price_per_mtok
            for e in config.model.endpoints
            if e.price_per_mtok is not None
        },
    )


def build_llm_factory(
    chain: Sequence[LLMAdapter], config: Config
) -> Callable[[Callable[[str, dict[str, Any]], None]], LLMAdapter]:
    def factory(on_event: Callable[[str, dict[str, Any]], None]) -> LLMAdapter:
        return ResilientLLM(
            chain=chain,
            max_retries=config.model.max_retries,
            max_retry_wait_s=config.model.max_retry_wait_s,
            on_event=on_event,
        )

    return factory


def check_tool_lists(config: Config, registry: ToolRegistry) -> None:
    """Tool lists in the config name real tools that their mode can ever have."""
    known = registry.names()
    problems = [
        f"tools.{key}: {problem}"
        for key, mode, names in (
            ("ipc_tools", Mode.IPC, config.tools.ipc_tools),
            ("headless_tools", Mode.HEADLESS, config.tools.headless_tools),
            ("headless_preapproved", Mode.HEADLESS, config.tools.headless_preapproved),
        )
        for problem in allowlist_problems(mode, names, known)
    ]
    for index, binding in enumerate(config.bindings):
        for key, names in (("tools", binding.tools), ("preapproved", binding.preapproved)):
            problems += [
                f"bindings.{index}.{key}: {problem}"
                for problem in allowlist_problems(Mode.DAEMON, names, known)
            ]
    pairing = config.pairing
    for key, names in (("tools", pairing.tools), ("preapproved", pairing.preapproved)):
        problems += [
            f"pairing.{key}: {problem}" for problem in allowlist_problems(Mode.DAEMON, names, known)
        ]
    if problems:
        raise ConfigError(str(config.source or "<config>"), problems)


async def open_mcp_pool(config: Config, stack: AsyncExitStack) -> ToolSource | None:
    """The configured MCP servers plus a trusted project's; none start until a session lists
    one of its tools (and only the servers of the tools it lists)."""
    servers = list(config.mcp.servers)
    project = config.project_mcp_config
    if project is not None:
        extra, ignored = load_project_servers(project, TrustStore(config.trust_path))
        if ignored is not None:
            log.warning("%s", ignored)
        names = {s.name for s in servers}
        for server in extra:
            if server.name in names:
                log.warning("project MCP server %s ignored: the global config has it", server.name)
            else:
                servers.append(server)
    if not servers:
        return None
    # Imported only when servers are configured: the mcp SDK alone takes over a second.
    from geodebot.engine.mcp.client import MCPServerPool

    # stdio servers run in the workspace, which must exist before the first one starts.
    return await stack.enter_async_context(
        MCPServerPool(
            servers,
            environ=os.environ,
            cwd=ensure_workspace(config.workspace),
            connect_grace_s=config.mcp.connect_grace_s,
        )
    )


@dataclass(frozen=True, slots=True)
class App:
    config: Config
    services: EngineServices
    lanes: Lanes
    # The one index of the bindings, which the router, the job tools and the scheduler share.
    bindings: BindingIndex
    # The model adapters, whose SDKs load on first use or when load_models() is called.
    adapters: tuple[DeferredAdapter, ...] = ()
    # Files users sent and files sent to them (see store/files.py).
    files: FileStore | None = None
    # Thread Relay's tools; the daemon connects its deliveries to the outbox and router.
    relay: ThreadRelay | None = None
    # This process's name among the replicas of one store ([daemon] replica_id, else made
    # at start: see app/store.py).
    replica_id: str = ""

    async def load_models(self) -> None:
        """Load the model SDKs now rather than at the first turn (each only once); a failure
        is logged, and turns then say so. ``geodebot serve`` calls it once it is READY: done
        before, the import (a second of CPU) would hold up connecting to the platforms."""
        started = time.monotonic()
        loaded = [a for a in self.adapters if await a.warm()]
        if loaded:
            names = ", ".join(f"{a.provider}/{a.model}" for a in loaded)
            log.info("models loaded (%s) in %.1f s", names, time.monotonic() - started)

    async def run_turn(
        self,
        mode: Mode,
        spec: SessionSpec,
        text: str,
        *,
        turn_id: str | None = None,
        ending: TurnEnding | None = None,
        attachments: Sequence[Block] = (),
        record_only: bool = False,
    ) -> TurnResult:
        """Run one turn in its session's lane (one at a time per session, global cap).

        A ``turn_id`` makes it safe to ask again after a crash: the same turn is continued
        (or its answer returned), never started over. ``ending``: see ``AgenticLoop.arun``."""
        async with self.lanes.slot(spec.session_id) as slot:
            session = await create_session(mode, spec, self.services, slot=slot)
            return await AgenticLoop(session).arun(
                text,
                turn_id=turn_id,
                ending=ending,
                attachments=attachments,
                record_only=record_only,
            )


async def build_app(
    config: Config,
    stack: AsyncExitStack,
    *,
    registry: ToolRegistry | None = None,
    observers: Sequence[Observer] = (),
) -> App:
    """Build every shared object once; ``stack`` owns their shutdown."""
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    system_prompt = load_system_prompt(config)
    redactor = build_redactor(config)

    replica = replica_id(config)
    store = make_store(config)
    await store.open()
    stack.push_async_callback(store.close)
    # Left before the store closes: the calls' records still being written go in first.
    spend = await stack.enter_async_context(SpendGate(store, spend_limits(config)))
    ledger = stack.enter_context(closing(EvidenceLedger(config.ledger_path, redactor)))
    endpoints = [config.model, *config.model.fallbacks]
    chain = [
        await stack.enter_async_context(aclosing(build_deferred_adapter(endpoint, config)))
        for endpoint in endpoints
    ]

    settings = BuiltinSettings(
        workspace=config.workspace,
        http_allow_hosts=config.tools.http_allow_hosts,
        http_allow_private=config.tools.http_allow_private,
        http_max_bytes=config.tools.http_max_bytes,
        http_timeout_s=config.tools.http_timeout_s,
        bash_timeout_s=config.tools.bash_timeout_s,
        computer_socket=config.tools.computer_socket,
    )
    pool = await open_mcp_pool(config, stack)
    registry = registry if registry is not None else ToolRegistry(builtin_tools(settings))
    bindings = BindingIndex(config.bindings)
    files = FileStore(config.files_dir)
    relay = ThreadRelay(
        store,
        bindings,
        config.relay,
        adapters=config.enabled_platforms,
        model=f"{config.model.provider}/{config.model.name}",
        ledger=ledger,
    )
    chat_tools = [
        *JobTools(store, bindings, default_timezone=config.daemon.timezone).specs(),
        send_file_spec(config.workspace, files),
        *relay.specs(),
        *MemoryTools(
            store, bindings, config.memory, terminal_project=config.relay.terminal_project
        ).specs(),
    ]
    for spec in chat_tools:
        if registry.get(spec.name) is None:
            registry.register(spec)
    check_tool_lists(config, registry)
    check_jobs(config, registry.names())
    hooks = HookRegistry([*hooks_from_config(config.hooks), *hooks_from_entry_points()])
    verifiers: list[Verifier] = [NonEmptyAnswer()]
    stop_hooks = hooks.stop_verifier()
    if stop_hooks is not None:
        verifiers.append(stop_hooks)

    services = EngineServices(
        store=store,
        llm=build_llm_factory(chain, config),
        tools=ToolCatalog(
            registry,
            {MCP_PREFIX: pool} if pool is not None else {},
        ),
        runner=ToolAuthority(
            store=store, hooks=hooks, approval_timeout_s=config.tools.approval_timeout_s
        ),
        verifiers=tuple(verifiers),
        ledger=ledger,
        redactor=redactor,
        system_prompt=system_prompt,
        budgets=config.budgets,
        limits=ModelLimits(config.model.max_tokens, config.model.context_tokens),
        observers=tuple(observers),
        context_cache=ContextCache(),
        files=FileView(files),
        spend=spend,
    )
    lanes = Lanes(config.daemon.max_concurrent_sessions)
    return App(config, services, lanes, bindings, tuple(chain), files, relay, replica)
