"""``geodebot init``: a configuration from nothing, its secrets checked live before it is
written.

It asks (in a terminal) or is told (flags, ``--yes``) which model provider and which platforms
to use, reads each secret without echo (or from the environment), checks each one as
``geodebot check`` does (the model's lookup, Telegram ``getMe``, Slack ``auth.test``,
Discord's own user), and only then writes two files: the config, which names each secret by
its variable, and an env file of the values (mode 0600, ``NAME=value`` lines, the form
systemd's ``EnvironmentFile=`` and a shell's ``set -a; . FILE`` read). An existing file is
never overwritten without ``--force``; a failed check writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import shlex
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from geodebot.config.schema import CONFIG_ENV, Config, ConfigError, parse_config

__all__ = ["add_init_parser", "init_command"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_CONFIG = Path("geodebot.toml")
PROVIDERS = ("anthropic", "openai", "openai-compatible")
DEFAULT_MODELS = {"anthropic": "claude-sonnet-4-5", "openai": "gpt-4.1", "openai-compatible": ""}
KEY_ENVS = {
    "anthropic": "ANTHROPIC_API_KEY",
    "openai": "OPENAI_API_KEY",
    "openai-compatible": "OPENAI_API_KEY",
}
PLATFORMS = ("telegram", "slack", "discord")
# The variables each platform's secrets go in, and what each one is.
PLATFORM_SECRETS: Mapping[str, tuple[tuple[str, str], ...]] = {
    "telegram": (("TELEGRAM_BOT_TOKEN", "the bot token from @BotFather"),),
    "slack": (
        ("SLACK_BOT_TOKEN", "the bot token (xoxb-...)"),
        ("SLACK_APP_TOKEN", "the app-level token with connections:write (xapp-...)"),
    ),
    "discord": (("DISCORD_BOT_TOKEN", "the bot token from the Developer Portal"),),
}
# What a failed live check of each part means for the person running init.
CHECK_HINTS = {
    "model": "check the API key and the model name (and base_url, if given)",
    "telegram": "check TELEGRAM_BOT_TOKEN (from @BotFather)",
    "slack": "check SLACK_BOT_TOKEN and SLACK_APP_TOKEN (and that Socket Mode is on)",
    "discord": "check DISCORD_BOT_TOKEN (Developer Portal, Bot)",
}


class InitError(Exception):
    """What stops init, in one line for the person running it."""


@dataclass(frozen=True, slots=True)
class Answers:
    provider: str
    model: str
    base_url: str | None
    platforms: tuple[str, ...]
    # Variable name -> value, for the model and every platform chosen.
    secrets: Mapping[str, str]
    api_urls: Mapping[str, str]
    state_dir: str


def add_init_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    init = sub.add_parser("init", help="write a config and its secrets, checked live")
    init.add_argument("--config", help=f"the config to write (default: ./{DEFAULT_CONFIG})")
    init.add_argument("--env-file", help="the secrets' file (default: beside the config, .env)")
    init.add_argument("--provider", choices=PROVIDERS)
    init.add_argument("--model", help="the model id sent to the provider")
    init.add_argument("--base-url", help="the model API's base URL (a local server, a proxy)")
    for platform in PLATFORMS:
        init.add_argument(f"--{platform}", action="store_true", help=f"use {platform}")
        init.add_argument(
            f"--{platform}-api-url", help=f"{platform}'s API base URL (default: the real one)"
        )
    init.add_argument("--state-dir", default="./var", help="where the daemon keeps its state")
    init.add_argument(
        "--yes", action="store_true", help="ask nothing: flags and secrets from the environment"
    )
    init.add_argument("--force", action="store_true", help="overwrite existing files")
    init.add_argument("--no-check", action="store_true", help="write without the live checks")


def init_command(
    args: argparse.Namespace,
    *,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
    read_secret: Callable[[str], str] = getpass.getpass,
) -> int:
    stdin = stdin if stdin is not None else sys.stdin
    stdout = stdout if stdout is not None else sys.stdout
    environ = environ if environ is not None else os.environ
    config_path = Path(args.config or environ.get(CONFIG_ENV) or DEFAULT_CONFIG)
    env_path = Path(args.env_file) if args.env_file else config_path.with_suffix(".env")
    try:
        _refuse_existing([config_path, env_path], force=args.force)
        ask = None if args.yes else _Asker(stdin, stdout, read_secret)
        if ask is None and not args.provider:
            raise InitError("--yes needs --provider (anthropic, openai or openai-compatible)")
        answers = _answers(args, ask, environ)
        text = config_text(answers, env_path)
        try:
            config = parse_config(tomllib.loads(text), source=config_path)
        except ConfigError as exc:
            problems = "; ".join(exc.problems)
            raise InitError(f"the config it would write is invalid: {problems}") from None
        if not args.no_check:
            _check(config, answers.secrets, stdout)
        _write(env_path, env_text(answers.secrets), mode=0o600)
        _write(config_path, text, mode=0o644)
    except InitError as exc:
        print(f"geodebot init: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("", file=stdout)
        return 130
    _next_steps(config_path, env_path, answers, stdout)
    return EXIT_OK


class _Asker:
    def __init__(self, stdin: TextIO, stdout: TextIO, read_secret: Callable[[str], str]) -> None:
        self._in, self._out, self._secret = stdin, stdout, read_secret

    def line(self, prompt: str, default: str = "") -> str:
        shown = f" [{default}]" if default else ""
        self._out.write(f"{prompt}{shown}: ")
        self._out.flush()
        answer = self._in.readline()
        if not answer:
            raise InitError("no answer (end of input)")
        return answer.strip() or default

    def yes(self, prompt: str, default: bool = False) -> bool:
        answer = self.line(f"{prompt} (y/n)", "y" if default else "n").lower()
        return answer in ("y", "yes")

    def secret(self, prompt: str) -> str:
        return self._secret(f"{prompt}: ").strip()


def _refuse_existing(paths: Sequence[Path], *, force: bool) -> None:
    for path in paths:
        if path.exists() and not force:
            raise InitError(f"{path} exists; --force overwrites it")


def _answers(args: argparse.Namespace, ask: _Asker | None, environ: Mapping[str, str]) -> Answers:
    provider = args.provider
    if provider is None:
        assert ask is not None
        provider = ask.line(f"Model provider ({', '.join(PROVIDERS)})", "anthropic")
        if provider not in PROVIDERS:
            raise InitError(f"unknown provider {provider!r}: one of {', '.join(PROVIDERS)}")
    base_url = args.base_url
    if base_url is None and ask is not None and provider == "openai-compatible":
        base_url = ask.line("Its base URL (e.g. http://127.0.0.1:8000/v1)")
    model = args.model
    if model is None and ask is not None:
        model = ask.line("Model", DEFAULT_MODELS[provider])
    model = model or DEFAULT_MODELS[provider]
    if not model:
        raise InitError("--model is needed for an openai-compatible provider")
    chosen = [p for p in PLATFORMS if getattr(args, p)]
    if ask is not None and not chosen:
        chosen = [p for p in PLATFORMS if ask.yes(f"Use {p.capitalize()}?", p == "telegram")]
    secrets: dict[str, str] = {}
    wanted = [(KEY_ENVS[provider], f"the {provider} API key")]
    wanted += [pair for p in chosen for pair in PLATFORM_SECRETS[p]]
    for name, what in wanted:
        secrets[name] = _secret(name, what, ask, environ)
    api_urls = {p: url for p in chosen if (url := getattr(args, f"{p}_api_url"))}
    return Answers(
        provider, model, base_url or None, tuple(chosen), secrets, api_urls, args.state_dir
    )


def _secret(name: str, what: str, ask: _Asker | None, environ: Mapping[str, str]) -> str:
    present = environ.get(name, "").strip()
    if ask is None:
        if not present:
            raise InitError(f"{name} ({what}) is not set in the environment")
        value = present
    else:
        kept = " (Enter keeps the one in the environment)" if present else ""
        value = ask.secret(f"{name}, {what}{kept}") or present
        if not value:
            raise InitError(f"{name} ({what}) is needed")
    if any(c in value for c in "\r\n\0") or value != value.strip():
        raise InitError(f"{name} holds a line break or surrounding spaces; paste it alone")
    return value


def config_text(answers: Answers, env_path: Path) -> str:
    """The config: every secret named by its variable, none of their values."""
    q = json.dumps  # a TOML basic string is a JSON string
    lines = [
        "# Written by `geodebot init`. Secrets are not in this file: each *_env key names a",
        f"# variable set in {env_path.name} (mode 0600; systemd: EnvironmentFile=).",
        "# Every key is in config.example.toml with what it does.",
        "",
        "[daemon]",
        f"state_dir = {q(answers.state_dir)}",
        "",
        "[model]",
        f"provider = {q(answers.provider)}",
        f"name = {q(answers.model)}",
        f"api_key_env = {q(KEY_ENVS[answers.provider])}",
    ]
    if answers.base_url:
        lines.append(f"base_url = {q(answers.base_url)}")
    for platform in answers.platforms:
        lines += ["", f"[channels.{platform}]"]
        names = [name for name, _ in PLATFORM_SECRETS[platform]]
        if platform == "slack":
            lines += [f"bot_token_env = {q(names[0])}", f"app_token_env = {q(names[1])}"]
        else:
            lines.append(f"token_env = {q(names[0])}")
        if platform in answers.api_urls:
            lines.append(f"api_base_url = {q(answers.api_urls[platform])}")
    lines += [
        "",
        "# No chat is bound yet. Write to the bot directly: it answers with a pairing code,",
        "# and `geodebot pairing approve PLATFORM CODE` lets you talk to it (no tools, unless",
        "# listed here). Or add a [[bindings]] table per chat (config.example.toml shows one).",
        "[pairing]",
        "enabled = true",
        "tools = []",
    ]
    return "\n".join(lines) + "\n"


def env_text(secrets: Mapping[str, str]) -> str:
    return "".join(f"{name}={value}\n" for name, value in secrets.items())


def _check(config: Config, secrets: Mapping[str, str], stdout: TextIO) -> None:
    """The live checks of ``geodebot check``, with the secrets given; a failure stops init
    with one line naming the part and what to look at."""
    # The checks load the SDKs of the parts configured: only when init gets that far.
    from geodebot.cli.check import run_checks

    saved = {name: os.environ.get(name) for name in secrets}
    os.environ.update(secrets)
    try:
        rows = asyncio.run(run_checks(config))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    failed = [row for row in rows if not row.ok]
    for row in rows:
        if row.ok and not row.what.startswith(("config", "secret ")):
            stdout.write(f"ok  {row.what}: {row.detail}\n")
    if failed:
        row = failed[0]
        part = row.what.split()[0]
        hint = CHECK_HINTS.get(part, "check its settings")
        raise InitError(f"{row.what} failed: {row.detail}; {hint}. Nothing was written.")


def _write(path: Path, text: str, *, mode: int) -> None:
    """Write ``path`` whole or not at all, with ``mode`` from its first byte on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise InitError(f"cannot write {path}: {exc.strerror or exc}") from None


def _next_steps(config_path: Path, env_path: Path, answers: Answers, stdout: TextIO) -> None:
    where = ", ".join(answers.platforms) or "the terminal chat only"
    # A shell's "." looks a bare name up on PATH: the env file is named as a path.
    env = shlex.quote(str(env_path) if "/" in str(env_path) else f"./{env_path}")
    config = shlex.quote(str(config_path))
    # make runs in the project's folder, which need not be this one.
    absolute = shlex.quote(str(config_path.resolve()))
    stdout.write(
        f"\nWrote {config_path} (model {answers.provider} {answers.model}; {where}) and "
        f"{env_path} (mode 0600).\n"
        "Start the daemon with its secrets:\n"
        f"  set -a && . {env} && set +a && make run CONFIG={absolute}\n"
        f"  (or, with the secrets set so, from here: geodebot serve --config {config})\n"
        "and talk to it from this machine:\n"
        f"  geodebot chat --config {config}\n"
    )
    if answers.platforms:
        stdout.write(
            "Then write to the bot directly on "
            f"{where}: it answers with a code; let yourself in with\n"
            f"  geodebot pairing approve PLATFORM CODE --config {config}\n"
        )
