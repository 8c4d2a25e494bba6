"""The ``geodebot`` command line.

Exit codes: 0 success; 1 the work failed (model error, budget, store, no daemon); 2 the
command or the configuration is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from geodebot import __version__
from geodebot.app.secrets import build_redactor
from geodebot.app.store import opened_store
from geodebot.channels.ipc import IPCClient, IPCError
from geodebot.cli.bindings import add_bindings_parser, bindings_command
from geodebot.cli.deadletters import add_deadletters_parser, deadletters_command
from geodebot.cli.init import add_init_parser, init_command
from geodebot.cli.jobs import add_jobs_parser, jobs_command
from geodebot.cli.memory import add_memory_parser, memory_command
from geodebot.cli.pairing import add_pairing_parser, pairing_command
from geodebot.cli.relay import add_relay_parser, print_schema, relay_command
from geodebot.cli.store import add_store_parser, store_command
from geodebot.cli.usage import add_usage_parser, usage_command
from geodebot.config.schema import Config, ConfigError, config_path, load_config, secret_names
from geodebot.logs.redact import Redactor
from geodebot.logs.setup import setup_logging
from geodebot.ops.systemd_unit import CREDENTIALS_DIR, DEFAULT_UNIT_PATH, layout_problems, unit_for
from geodebot.store.records import StoreError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config",
        metavar="FILE",
        help="configuration file (default: $GEODEBOT_CONFIG, then /etc/geodebot/config.toml)",
    )
    parser = argparse.ArgumentParser(prog="geodebot", description="chat-ops agent daemon")
    parser.add_argument("--version", action="version", version=f"geodebot {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", parents=[common], help="one headless turn; answer on stdout")
    run.add_argument("--session", help="session id to continue (default: a new one)")
    run.add_argument("--time-budget", type=float, metavar="S", help="seconds for the turn")
    run.add_argument("prompt")

    sub.add_parser("serve", parents=[common], help="run the daemon")

    chat = sub.add_parser("chat", parents=[common], help="chat with the daemon from a terminal")
    chat.add_argument("--session", help="session id (default: ipc:<user>)")

    sessions = sub.add_parser("sessions", help="inspect sessions")
    sessions_sub = sessions.add_subparsers(dest="action", required=True)
    sessions_sub.add_parser("list", parents=[common])
    for action in ("show", "reset"):
        p = sessions_sub.add_parser(action, parents=[common])
        p.add_argument("id")

    operator = sub.add_parser("operator", help="operator switches")
    operator_sub = operator.add_subparsers(dest="switch", required=True)
    computer = operator_sub.add_parser(
        "computer-use", parents=[common], help="allow the computer tool in daemon sessions"
    )
    computer.add_argument("state", choices=["on", "off", "status"])
    computer.add_argument("--for", dest="duration", help="expire after e.g. 30m, 2h, 1d")
    computer.add_argument("--reason", default="")

    receipts = sub.add_parser("receipts", help="effect receipts of tool calls")
    receipts_sub = receipts.add_subparsers(dest="action", required=True)
    listing = receipts_sub.add_parser("list", parents=[common])
    listing.add_argument("--uncertain", action="store_true", help="only unresolved uncertain")
    listing.add_argument("--session")
    listing.add_argument("--limit", type=int, default=100)
    resolve = receipts_sub.add_parser("resolve", parents=[common])
    resolve.add_argument("id")
    resolve.add_argument("--as", dest="resolution", choices=["done", "failed"], required=True)

    config_cmd = sub.add_parser("config", help="configuration trust")
    config_sub = config_cmd.add_subparsers(dest="action", required=True)
    trust = config_sub.add_parser("trust", parents=[common], help="trust a project config")
    trust.add_argument("path")

    mcp = sub.add_parser("mcp", help="geodebot as an MCP server")
    mcp_sub = mcp.add_subparsers(dest="action", required=True)
    mcp_sub.add_parser("serve", parents=[common], help="serve run_agent over stdio")

    add_jobs_parser(sub, common)
    add_relay_parser(sub, common)
    add_deadletters_parser(sub, common)
    add_usage_parser(sub, common)
    add_store_parser(sub, common)
    add_pairing_parser(sub, common)
    add_bindings_parser(sub, common)
    add_memory_parser(sub, common)

    timeline = sub.add_parser("timeline", parents=[common], help="a session's timeline")
    timeline.add_argument("id")
    timeline.add_argument("--json", action="store_true", help="one JSON object per line")
    timeline.add_argument("--limit", type=int, default=None)

    sub.add_parser(
        "check", parents=[common], help="is this configuration ready: secrets, model, platforms"
    )
    add_init_parser(sub)
    status = sub.add_parser("status", parents=[common], help="ask the running daemon")
    status.add_argument("--json", action="store_true")
    desktop = sub.add_parser(
        "desktop-agent", help="serve computer-use actions on an X display (its own service)"
    )
    desktop.add_argument("--socket", type=Path, required=True, help="unix socket to listen on")
    desktop.add_argument("--display", default=os.environ.get("DISPLAY", ":0"))
    service = sub.add_parser("service", help="run geodebot as a systemd service")
    service_sub = service.add_subparsers(dest="action", required=True)
    install = service_sub.add_parser(
        "install", parents=[common], help="write the systemd unit for this installation"
    )
    install.add_argument("--output", type=Path, default=DEFAULT_UNIT_PATH)
    install.add_argument("--print", action="store_true", help="print the unit, write nothing")
    return parser


def _load(args: argparse.Namespace) -> Config:
    return load_config(config_path(args.config))


def _without_config(args: argparse.Namespace) -> int | None:
    """Run the commands that read no configuration; None for every other one."""
    if args.command == "init":
        # It writes the configuration: there is none to load yet.
        return init_command(args)
    if args.command == "desktop-agent":
        # Runs in its own service beside the display; it reads no configuration.
        return _desktop_agent(args)
    if args.command == "relay" and args.action == "schema":
        # The contracts are the code's, whatever the configuration.
        return print_schema()
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    done = _without_config(args)
    if done is not None:
        return done
    try:
        config = _load(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"geodebot: config error: {exc.source}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(config.daemon.log_level, build_redactor(config), quiet=args.command != "serve")
    handler = {
        "run": _run,
        "serve": _serve,
        "chat": _chat,
        "sessions": _sessions,
        "timeline": _timeline,
        "operator": _operator,
        "receipts": _receipts,
        "config": _config,
        "mcp": _mcp,
        "service": _service,
        "check": _check,
        "status": _status,
        "jobs": jobs_command,
        "relay": relay_command,
        "deadletters": deadletters_command,
        "usage": usage_command,
        "store": store_command,
        "pairing": pairing_command,
        "bindings": bindings_command,
        "memory": memory_command,
    }[args.command]
    try:
        return asyncio.run(handler(config, args))
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"geodebot: config error: {exc.source}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    except (StoreError, IPCError) as exc:
        print(f"geodebot: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        # The state directory or socket cannot be created: say which path, not a traceback.
        where = f" {exc.filename}" if exc.filename else ""
        print(f"geodebot: cannot use{where}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


async def _run(config: Config, args: argparse.Namespace) -> int:
    from geodebot.app.build import build_app
    from geodebot.engine.loop import new_id
    from geodebot.engine.modes import Mode
    from geodebot.engine.session import SessionSpec

    async with AsyncExitStack() as stack:
        app = await build_app(config, stack)
        spec = SessionSpec(
            args.session or new_id("run"),
            tools=config.tools.headless_tools,
            preapproved=config.tools.headless_preapproved,
            time_budget_s=args.time_budget,
        )
        result = await app.run_turn(Mode.HEADLESS, spec, args.prompt)
    if result.ok:
        print(result.text)
        return EXIT_OK
    print(f"geodebot: {result.text}", file=sys.stderr)
    return EXIT_FAILED


async def _check(config: Config, args: argparse.Namespace) -> int:
    from geodebot.cli.check import format_rows, run_checks

    rows = await run_checks(config)
    print(format_rows(rows))
    return EXIT_OK if all(row.ok for row in rows) else EXIT_FAILED


async def _status(config: Config, args: argparse.Namespace) -> int:
    async with IPCClient(config.socket_path) as client:
        answer = await client.request({"op": "status"})
    if answer.get("op") != "status":
        raise IPCError(str(answer.get("message", answer)))
    if args.json:
        print(json.dumps(answer, indent=2, sort_keys=True))
        return EXIT_OK
    print(
        f"geodebot pid {answer['pid']}, up {answer['uptime_s']:.0f} s, "
        f"{'ready' if answer['ready'] else 'starting: not every channel connected'}"
    )
    print(f"replica {answer.get('replica_id', '?')}, store {_store_line(answer.get('store'))}")
    for line in _replica_lines(answer.get("lease"), answer.get("peers"), answer.get("sessions")):
        print(line)
    for name, channel in answer["channels"].items():
        state = "connected" if channel["connected"] else f"down ({channel['detail']})"
        print(f"  {name}: {state}")
    for line in _config_lines(answer):
        print(line)
    print(
        f"turns: {answer['turns_running']} running (at most "
        f"{answer['max_concurrent_sessions']}), {answer['queued']} queued"
    )
    messages = answer.get("messages", {})
    dropped = sum(n for event, n in messages.items() if event.startswith("dropped:"))
    print(
        f"messages: {messages.get('received', 0)} received, {messages.get('accepted', 0)} "
        f"accepted, {dropped} dropped by the gate, {messages.get('throttled', 0)} throttled"
    )
    inbox, outbox = answer["inbox"], answer["outbox"]
    print(
        f"inbox: {inbox.get('pending', 0) + inbox.get('running', 0)} unfinished; "
        f"outbox: {outbox.get('pending', 0)} pending, {outbox.get('failed', 0)} failed"
    )
    late = answer.get("unanswered", {})
    if late.get("count"):
        print(
            f"unanswered: {late['count']} message(s) without a reply for over "
            f"{late['alert_s']:g} s, the oldest {late['oldest_age_s']:.0f} s"
        )
    if answer.get("deadletters"):
        print(f"dead letters: {answer['deadletters']} (geodebot deadletters list)")
    print(f"computer use: {'on' if answer['computer_use']['enabled'] else 'off'}")
    usage = answer.get("model_usage_today", {})
    if usage.get("calls"):
        read, total = usage["cache_read_tokens"], usage["input_tokens"]
        print(
            f"model today: {usage['calls']} calls, {total:,} input tokens "
            f"({read / total if total else 0:.0%} from the prompt cache), "
            f"{usage['output_tokens']:,} output, ${usage['cost_usd']:.4f}"
        )
    process = answer.get("process", {})
    rss = process.get("rss_bytes")
    print(
        f"process: RSS {'?' if rss is None else f'{rss / 1e6:.1f} MB'}, "
        f"{process.get('open_fds', '?')} open files, {process.get('threads', '?')} threads, "
        f"{process.get('asyncio_tasks', '?')} tasks"
    )
    for job in answer.get("jobs", []):
        print(f"job {job['id']}: next {job['next']}; last {job['last']}")
    return EXIT_OK


def _config_lines(answer: dict[str, Any]) -> list[str]:
    """The config in force (its hash, when it was read) and the bindings by origin."""
    lines = []
    loaded = answer.get("config")
    if loaded:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(loaded["loaded_at"]))
        lines.append(f"config {loaded['path']}: sha256 {loaded['sha256'][:16]}, loaded {when}")
    messages = answer.get("messages", {})
    if any(key.startswith("pairing:") for key in messages):
        lines.append(
            f"pairing: {messages.get('pairing:code', 0)} codes given, "
            f"{messages.get('pairing:full', 0)} strangers refused over max_pending "
            "(geodebot pairing list)"
        )
    bound = answer.get("bindings")
    if bound:
        shadowed = f", {bound['shadowed']} shadowed" if bound["shadowed"] else ""
        lines.append(
            f"bindings: {bound['config']} from the config, {bound['stored']} stored{shadowed}"
        )
    return lines


def _replica_lines(
    lease: dict[str, Any] | None,
    peers: list[dict[str, Any]] | None,
    sessions: dict[str, Any] | None = None,
) -> list[str]:
    """The daemon's lease, the sessions held here and the other replicas, when replicas
    share the store."""
    if lease is None:
        return []
    lines = [
        f"lease {lease['name']}: {'leading' if lease['leading'] else 'not leading'}, "
        f"epoch {lease['epoch']}, {lease['takeovers']} takeover(s) so far"
    ]
    if sessions is not None:
        lines.append(
            f"sessions held here: {sessions['held']} ({sessions['taken']} taken, "
            f"{sessions['lost']} lost so far)"
        )
    for peer in peers or []:
        heard = f"seen {peer['seen_s_ago']:g} s ago" + (" (silent)" if peer["silent"] else "")
        lines.append(
            f"  peer {peer['id']}: {peer['role']} on {peer['host']} (pid {peer['pid']}), {heard}"
        )
    if not peers:
        lines.append("  no other replica")
    return lines


def _store_line(store: dict[str, Any] | None) -> str:
    if not store:
        return "?"
    if store.get("kind") == "sqlite":
        return f"sqlite {store.get('path')}"
    return f"{store.get('kind')} {store.get('host')}:{store.get('port')}/{store.get('dbname')}"


def _desktop_agent(args: argparse.Namespace) -> int:
    from geodebot.desktop.agent import DesktopAgent, DesktopError, serve_agent

    setup_logging("info", Redactor())
    try:
        agent = DesktopAgent(args.display)
    except DesktopError as exc:
        print(f"geodebot: {exc}", file=sys.stderr)
        return EXIT_FAILED

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve_agent(args.socket, agent, stop)

    try:
        asyncio.run(run())
    except OSError as exc:
        print(f"geodebot: cannot serve on {args.socket}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


async def _service(config: Config, args: argparse.Namespace) -> int:
    return _install_service(config, args)


def _install_service(config: Config, args: argparse.Namespace) -> int:
    problems = layout_problems(config)
    for problem in problems:
        print(f"geodebot: {problem}", file=sys.stderr)
    if problems:
        return EXIT_USAGE
    source = config.source or config_path(args.config)
    unit = unit_for(config, Path(source).resolve())
    if args.print:
        print(unit, end="")
        return EXIT_OK
    args.output.write_text(unit, encoding="utf-8")
    args.output.chmod(0o644)
    print(f"wrote {args.output}")
    names = sorted(set(secret_names(config)))
    missing = [n for n in names if not (CREDENTIALS_DIR / n).is_file()]
    if missing:
        print(
            f"put each secret in {CREDENTIALS_DIR}/<NAME> (mode 0600, root): " + ", ".join(missing)
        )
    print("then: systemctl daemon-reload && systemctl enable --now geodebot")
    return EXIT_OK


async def _serve(config: Config, args: argparse.Namespace) -> int:
    from geodebot.app.daemon import serve

    lost = await serve(config)
    if lost is not None:
        # Not a clean stop: systemd (Restart=on-failure) starts it again.
        print(f"geodebot: stopped serving: {lost}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


async def _chat(config: Config, args: argparse.Namespace) -> int:
    session = args.session or f"ipc:{getpass.getuser()}"
    interactive = sys.stdin.isatty()
    async with IPCClient(config.socket_path) as client:
        pong = await client.request({"op": "ping"})
        if pong.get("op") != "pong":
            raise IPCError("the daemon did not answer the ping")
        if interactive:
            print(f"geodebot chat, session {session}. Ctrl-D to leave.")
        status = EXIT_OK
        while True:
            line = await asyncio.to_thread(_read_line, "> " if interactive else "")
            if line is None:
                return status
            if not line.strip():
                continue
            answer = await client.turn(session, line, _ask_terminal)
            if answer.get("op") == "reply":
                print(answer.get("text", ""), flush=True)
                if answer.get("outcome") != "completed":
                    status = EXIT_FAILED
            else:
                print(f"geodebot: {answer.get('message', answer)}", file=sys.stderr, flush=True)
                status = EXIT_FAILED


async def _ask_terminal(request: dict[str, Any]) -> bool:
    arguments = json.dumps(request.get("arguments", {}), ensure_ascii=False)
    if len(arguments) > 500:
        arguments = arguments[:500] + "…"
    print(
        f"geodebot asks to run {request.get('tool')} ({request.get('safety')}, "
        f"{request.get('effect')}) with {arguments}\n  reason: {request.get('reason')}",
        flush=True,
    )
    answer = await asyncio.to_thread(_read_line, "Allow? [y/N] ")
    return answer is not None and answer.strip().lower() in ("y", "yes")


def _read_line(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


async def _sessions(config: Config, args: argparse.Namespace) -> int:
    async with opened_store(config) as store:
        if args.action == "list":
            rows = await store.list_sessions()
            print(f"{'SESSION':<32} {'MODE':<9} {'GEN':>3} {'TURNS':>5}  UPDATED")
            for r in rows:
                turns = r.state.get("turns", 0)
                print(f"{r.id:<32} {r.mode:<9} {r.generation:>3} {turns:>5}  {_when(r.updated_at)}")
            return EXIT_OK
        record = await store.get_session(args.id)
        if record is None:
            print(f"geodebot: no session {args.id!r}", file=sys.stderr)
            return EXIT_FAILED
        if args.action == "reset":
            record = await store.reset_session(args.id)
            print(f"session {args.id} reset; generation {record.generation}")
            return EXIT_OK
        context = await store.load_context(args.id)
        pending = await store.pending_batches(args.id)
        info: dict[str, Any] = {
            "id": record.id,
            "mode": record.mode,
            "generation": record.generation,
            "created": _when(record.created_at),
            "updated": _when(record.updated_at),
            "state": dict(record.state),
            "guards": dict(record.guards),
            "context_messages": len(context),
            "pending_tool_batches": len(pending),
        }
        print(json.dumps(info, indent=2, ensure_ascii=False))
        return EXIT_OK


async def _timeline(config: Config, args: argparse.Namespace) -> int:
    async with opened_store(config) as store:
        events = await store.timeline(args.id, limit=args.limit)
    for e in events:
        if args.json:
            row = {"id": e.id, "ts": e.ts, "turn": e.turn_id, "kind": e.kind, "data": e.data}
            print(json.dumps(row, ensure_ascii=False))
        else:
            data = " ".join(f"{k}={v}" for k, v in e.data.items() if v is not None)
            print(f"{_when(e.ts)}  {e.turn_id or '-':<20} {e.kind:<22} {data}")
    return EXIT_OK


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        value, unit = float(text[:-1]), units[text[-1]]
    except (ValueError, KeyError, IndexError):
        raise ConfigError("--for", [f"{text!r} is not a duration like 30m, 2h or 1d"]) from None
    if value <= 0:
        raise ConfigError("--for", ["the duration must be positive"])
    return value * unit


async def _operator(config: Config, args: argparse.Namespace) -> int:
    from geodebot.engine.session import COMPUTER_USE_SWITCH

    async with opened_store(config, create=True) as store:
        if args.state == "status":
            switch = await store.get_switch(COMPUTER_USE_SWITCH)
        else:
            expires = time.time() + _duration(args.duration) if args.duration else None
            switch = await store.set_switch(
                COMPUTER_USE_SWITCH,
                args.state == "on",
                by=getpass.getuser(),
                expires_at=expires,
                reason=args.reason,
            )
    if switch is None or not switch.active(time.time()):
        state = "off"
    else:
        until = f" until {_when(switch.expires_at)}" if switch.expires_at else ""
        state = f"on{until}"
    print(f"computer use: {state}")
    if switch is not None:
        reason = f" ({switch.reason})" if switch.reason else ""
        print(f"last set by {switch.set_by} at {_when(switch.set_at)}{reason}")
    return EXIT_OK


async def _receipts(config: Config, args: argparse.Namespace) -> int:
    async with opened_store(config) as store:
        if args.action == "resolve":
            receipt = await store.resolve_receipt(args.id, args.resolution, by=getpass.getuser())
            print(f"receipt {receipt.id} resolved as {receipt.resolution}")
            return EXIT_OK
        rows = await store.list_receipts(
            status="uncertain" if args.uncertain else None,
            session_id=args.session,
            unresolved_only=args.uncertain,
            limit=args.limit,
        )
    print(f"{'RECEIPT':<20} {'STATUS':<10} {'RESOLVED':<8} {'TOOL':<20} {'SESSION':<24} ADMITTED")
    for r in rows:
        print(
            f"{r.id:<20} {r.status:<10} {r.resolution or '-':<8} {r.tool:<20} "
            f"{r.session_id:<24} {_when(r.admitted_at)}"
        )
    return EXIT_OK


async def _config(config: Config, args: argparse.Namespace) -> int:
    from geodebot.engine.mcp.trust import TrustStore

    trust = TrustStore(config.trust_path)
    entry = trust.trust(Path(args.path), by=getpass.getuser())
    print(f"trusted {entry.path} (sha256 {entry.sha256[:16]}…); re-run after every change")
    return EXIT_OK


async def _mcp(config: Config, args: argparse.Namespace) -> int:
    from geodebot.cli.mcp_server import serve_mcp

    await serve_mcp(config)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
