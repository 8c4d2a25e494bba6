"""Configuration: TOML validated by pydantic, with errors that name the key.

Pure data plus reading the file. Secrets never sit in the file: ``*_env`` keys name an
environment variable, and a systemd credential of the same name in ``$CREDENTIALS_DIRECTORY``
is read too (see :func:`resolve_secret`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlsplit

import tomli as tomllib
from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from geodebot.config.jobs import ConfigModel, JobConfig, check_timezone

DEFAULT_CONFIG_PATH = Path("/etc/geodebot/config.toml")
CONFIG_ENV = "GEODEBOT_CONFIG"
DB_FILE = "geodebot.db"
LEDGER_FILE = "ledger.jsonl"
SOCKET_FILE = "geodebot.sock"
FILES_DIR = "files"
TRUST_FILE = "trust.json"

Provider = Literal["anthropic", "openai", "openai-compatible"]

DEFAULT_KEY_ENV: dict[str, str] = {
    "anthropic": "ANTHROPIC_API_KEY",
    "openai": "OPENAI_API_KEY",
    "openai-compatible": "OPENAI_API_KEY",
}


class ConfigError(Exception):
    """The configuration cannot be used. ``problems`` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(problems))
        self.source = source
        self.problems = problems


# Every table's model: unknown keys are errors, values are frozen, and numbers are not
# booleans (see config.jobs.ConfigModel, shared with the [[jobs]] table).
_Strict = ConfigModel


def split_host_port(address: str) -> tuple[str, int]:
    """``"127.0.0.1:8787"`` or ``"[::1]:8787"`` -> (host, port); ValueError if malformed."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port (e.g. 127.0.0.1:8787)")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_REPLICA_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


class DaemonConfig(_Strict):
    state_dir: Path = Path("./var")
    # Default timezone of scheduled jobs.
    timezone: str = "UTC"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Turns running at once across all sessions; one turn at a time per session regardless.
    max_concurrent_sessions: Annotated[int, Field(ge=1, le=1024)] = 8
    # Messages waiting per session while its turn runs; more get a "busy" answer.
    session_queue: Annotated[int, Field(ge=1, le=1000)] = 10
    # Flood control per sender (platform, user): turns started per minute, and how many may
    # come at once. Over it a message is dropped (no model call) and the sender gets one short
    # notice a minute. user_rate_per_min = 0 switches it off.
    user_rate_per_min: Annotated[float, Field(ge=0, le=6000)] = 30.0
    user_burst: Annotated[int, Field(ge=1, le=1000)] = 10
    # On SIGTERM, running turns get this long to finish before they are cancelled.
    shutdown_grace_s: Annotated[float, Field(ge=0, le=600)] = 20.0
    # A streamed answer edits its chat's message at most once per this interval.
    stream_edit_interval_s: Annotated[float, Field(ge=0.2, le=60)] = 1.0
    # An accepted message still without a reply this long after it came (its turn not
    # waiting for an approval) is reported: on /healthz (component "unanswered", unhealthy),
    # in /metrics and in geodebot status.
    unanswered_alert_s: Annotated[float, Field(ge=1)] = 300.0
    # Health and metrics over HTTP ("host:port"); off when unset. Loopback only unless
    # allow_remote, which also needs a bearer token (http_token_env names its variable).
    allow_remote: bool = False
    http_token_env: str | None = None
    http: str | None = None
    # The console's address as browsers see it, when a reverse proxy serves it (and ends TLS
    # there): "https://ops.example.com". Forms must then come from that origin rather than
    # from the plain-http one the proxy calls, and cookies are marked Secure.
    console_url: str | None = None
    # This process's name among the replicas sharing a [store] url: in geodebot status, and
    # what its work is recorded under. Absent: "<hostname>-<pid>", made when the daemon
    # starts (so two processes started from one file differ).
    replica_id: str | None = None

    @field_validator("replica_id")
    @classmethod
    def _replica_id(cls, value: str | None) -> str | None:
        if value is not None and not _REPLICA_ID.fullmatch(value):
            raise ValueError("must be 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' and '-'")
        return value

    @field_validator("console_url")
    @classmethod
    def _console_url(cls, value: str | None) -> str | None:
        if not value:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// address, e.g. https://ops.example.com")
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
            raise ValueError(
                "must be the console's origin only (scheme, host and port): the console "
                "is served at the root of its address"
            )
        return f"{parts.scheme}://{parts.netloc.lower()}"

    @field_validator("http")
    @classmethod
    def _http(cls, value: str | None, info: ValidationInfo) -> str | None:
        if not value:
            return None
        host, _ = split_host_port(value)
        if not is_loopback(host):
            if not info.data.get("allow_remote"):
                raise ValueError(
                    f"{host} is not a loopback address; the health and metrics endpoint stays "
                    "on loopback unless daemon.allow_remote = true (with daemon.http_token_env)"
                )
            if not info.data.get("http_token_env"):
                raise ValueError("daemon.http_token_env is required with allow_remote = true")
        return value

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, value: str) -> str:
        return check_timezone(value)


class StoreConfig(_Strict):
    """Where the durable state lives: SQLite in the state directory (the default, one process),
    or a PostgreSQL database several processes share."""

    # postgresql://USER@HOST[:PORT]/DBNAME[?sslmode=...]; absent: SQLite in state_dir.
    url: str | None = None
    # The environment variable (or systemd credential) holding the database's password; a
    # password never sits in url, where backups and logs would keep it.
    password_env: str | None = None
    # With url set, the replicas' leases (the daemon's, each session's) last this long,
    # renewed every third of it; another replica takes over this long after one stops.
    lease_ttl_s: Annotated[float, Field(ge=3, le=300)] = 15.0

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        # The messages never repeat the URL: it may hold the very password they refuse.
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError:
            raise ValueError(
                "is not a valid URL: write postgresql://USER@HOST[:PORT]/DBNAME"
            ) from None
        if parts.scheme not in ("postgresql", "postgres"):
            raise ValueError(
                "must be a postgresql:// (or postgres://) URL, e.g. "
                "postgresql://geodebot@db.internal/geodebot"
            )
        in_query = any(key == "password" for key, _ in parse_qsl(parts.query))
        if parts.password is not None or in_query:
            raise ValueError(
                "must not hold a password (a config file ends up in backups and logs): put "
                "the password in an environment variable or systemd credential and name it "
                "in store.password_env"
            )
        if port is not None and not 0 < port < 65536:
            raise ValueError("has a port outside 1..65535")
        return value

    @model_validator(mode="after")
    def _password_needs_url(self) -> StoreConfig:
        if self.password_env is not None and self.url is None:
            raise ValueError("password_env needs url (SQLite has no password)")
        return self


_Price = Annotated[float, Field(ge=0, le=10_000)]


class Prices(_Strict):
    """US dollars per million tokens. Cache prices default to the input price (a provider
    that bills its cache differently needs them set to be counted right)."""

    input: _Price
    output: _Price
    cache_read: _Price | None = None
    cache_write: _Price | None = None

    def cost(
        self, input_tokens: int, output_tokens: int, cache_read: int, cache_write: int
    ) -> float:
        """The cost of a call; ``input_tokens`` counts the cached tokens too (see Usage)."""
        plain = max(0, input_tokens - cache_read - cache_write)
        read = self.input if self.cache_read is None else self.cache_read
        write = self.input if self.cache_write is None else self.cache_write
        return (
            plain * self.input + cache_read * read + cache_write * write
            + output_tokens * self.output
        ) / 1_000_000  # fmt: skip

    @property
    def highest_input(self) -> float:
        """The most an input token can cost: what a reservation assumes."""
        return max(p for p in (self.input, self.cache_read, self.cache_write) if p is not None)


class ModelEndpoint(_Strict):
    provider: Provider = "anthropic"
    # The exact model id sent to the provider; geodebot never rewrites or upgrades it.
    name: Annotated[str, Field(min_length=1)] = "claude-sonnet-4-5"
    base_url: str | None = None
    api_key_env: str | None = None
    # What the model's tokens cost: `geodebot usage` reports cost with them, and
    # [model] daily_usd needs them on every endpoint.
    price_per_mtok: Prices | None = None

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value

    @model_validator(mode="after")
    def _compatible_needs_url(self) -> ModelEndpoint:
        if self.provider == "openai-compatible" and self.base_url is None:
            raise ValueError("base_url is required when provider is openai-compatible")
        return self

    @property
    def key_env(self) -> str:
        return self.api_key_env or DEFAULT_KEY_ENV[self.provider]


class ModelConfig(ModelEndpoint):
    max_retries: Annotated[int, Field(ge=0, le=10)] = 2
    max_retry_wait_s: Annotated[float, Field(gt=0, le=600)] = 30.0
    request_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 4096
    # The context window geodebot plans for; compaction starts at budgets.compact_at of it.
    context_tokens: Annotated[int, Field(ge=1024)] = 200_000
    fallbacks: tuple[ModelEndpoint, ...] = ()
    # Anthropic: mark the prompt cache's breakpoints (tools, system prompt, the history's
    # newest turns), so a long session's repeated prefix is billed at the cache rate.
    prompt_cache: bool = True
    # The whole daemon's spend per UTC day, in US dollars, from price_per_mtok; None: no limit.
    daily_usd: Annotated[float, Field(gt=0, le=1_000_000)] | None = None

    @model_validator(mode="after")
    def _usd_needs_prices(self) -> ModelConfig:
        if self.daily_usd is None:
            return self
        missing = [e.name for e in (self, *self.fallbacks) if e.price_per_mtok is None]
        if missing:
            raise ValueError(
                "daily_usd needs price_per_mtok on the model and every fallback; "
                f"missing on: {', '.join(missing)}"
            )
        return self

    @property
    def endpoints(self) -> tuple[ModelEndpoint, ...]:
        return (self, *self.fallbacks)


class BudgetConfig(_Strict):
    daemon_time_s: Annotated[float, Field(gt=0, le=86_400)] = 120.0
    ipc_time_s: Annotated[float, Field(gt=0, le=86_400)] = 600.0
    headless_time_s: Annotated[float, Field(gt=0, le=86_400)] = 300.0
    # Upper bound for any HEADLESS request (geodebot run, MCP run_agent), whatever it asks.
    headless_max_time_s: Annotated[float, Field(gt=0, le=86_400)] = 1800.0
    max_rounds: Annotated[int, Field(ge=1, le=500)] = 24
    repair_budget: Annotated[int, Field(ge=0, le=10)] = 2
    compact_at: Annotated[float, Field(gt=0.1, lt=1.0)] = 0.75
    # Messages kept verbatim after a compaction.
    keep_recent_messages: Annotated[int, Field(ge=2, le=1000)] = 8
    # Tokens (input, cached input included, and output) the whole daemon may spend per UTC
    # day; 0: no limit. A model call reserves its worst case first (see engine/spend.py).
    daily_tokens: Annotated[int, Field(ge=0)] = 0


class PromptSource(_Strict):
    text: str | None = None
    file: Path | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> PromptSource:
        if (self.text is None) == (self.file is None):
            raise ValueError("give exactly one of text or file")
        return self


class PromptConfig(_Strict):
    sources: tuple[PromptSource, ...] = (
        PromptSource(
            text="You are geodebot, a careful assistant running unattended in a team chat. "
            "Answer concisely. Use only the tools you are given."
        ),
    )


SafetyName = Literal["read", "write", "dangerous"]
EffectName = Literal["none", "mutate", "communicate", "administrative"]


class ToolsConfig(_Strict):
    # Root of everything the file tools may touch; relative to the config file's folder.
    workspace: Path = Path("./workspace")
    # http_get may fetch only these hosts (exact names, or "*.example.com" for subdomains).
    http_allow_hosts: tuple[str, ...] = ()
    # Loopback, private and link-local addresses are refused unless this is true.
    http_allow_private: bool = False
    http_max_bytes: Annotated[int, Field(ge=1, le=50_000_000)] = 1_000_000
    http_timeout_s: Annotated[float, Field(gt=0, le=300)] = 20.0
    bash_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    # The unix socket of `geodebot desktop-agent`; without it the computer tool refuses.
    computer_socket: Path | None = None
    # How long `geodebot chat` has to answer an approval request before it counts as "no".
    approval_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    # Tools of terminal chat sessions; writes are asked for at the terminal.
    ipc_tools: tuple[str, ...] = (
        "get_time",
        "read_file",
        "list_dir",
        "search_files",
        "write_file",
        "edit_file",
    )
    # Tools of `geodebot run` and MCP run_agent; nobody can approve there, so a write runs only
    # if it is also in headless_preapproved.
    headless_tools: tuple[str, ...] = ("get_time",)
    headless_preapproved: tuple[str, ...] = ()


HookEvent = Literal["PreToolUse", "PostToolUse", "Stop"]


class HookConfig(_Strict):
    """An operator's command hook: gets the event as JSON on stdin, answers JSON on stdout."""

    event: HookEvent
    command: tuple[str, ...] = Field(min_length=1)
    # Tool names the hook applies to; empty means every tool (ignored for Stop).
    tools: tuple[str, ...] = ()
    timeout_s: Annotated[float, Field(gt=0, le=300)] = 10.0


class MCPToolPolicy(_Strict):
    """What the operator declares about an MCP tool; undeclared tools are never callable."""

    safety: SafetyName
    effect: EffectName
    resource_keys: tuple[str, ...] = ()
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0


class MCPServerConfig(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,32}$")]
    transport: Literal["stdio", "http"] = "stdio"
    # stdio: the program and its arguments; env lists variables passed through by name.
    command: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    # http: the streamable-HTTP endpoint.
    url: str | None = None
    tools: dict[str, MCPToolPolicy] = Field(default_factory=dict)
    # After a call times out, the server must answer a health check within this, or it is
    # restarted; calls meanwhile wait for the verdict.
    probe_timeout_s: Annotated[float, Field(gt=0, le=300)] = 10.0

    @model_validator(mode="after")
    def _transport_fields(self) -> MCPServerConfig:
        if self.transport == "stdio" and not self.command:
            raise ValueError("command is required for transport stdio")
        if self.transport == "http" and not self.url:
            raise ValueError("url is required for transport http")
        return self


class MCPConfig(_Strict):
    servers: tuple[MCPServerConfig, ...] = ()
    # How long a session's set-up waits at most for the servers of the tools it lists (never
    # more than a tenth of its time budget); a server not up by then is waited for by a call
    # to one of its tools, within that call's deadline.
    connect_grace_s: Annotated[float, Field(ge=0, le=60)] = 3.0
    # A project's own MCP servers (same [[servers]] format); used only once trusted with
    # `geodebot config trust PATH`, and only while the file is unchanged since.
    project_config: Path | None = None


class _ChannelBase(_Strict):
    # A channel runs when its table is present and enabled is true.
    enabled: bool = True
    # Messages longer than this get a short refusal and no model call.
    max_message_chars: Annotated[int, Field(ge=1, le=1_000_000)] = 16_000


class TelegramConfig(_ChannelBase):
    token_env: str = "TELEGRAM_BOT_TOKEN"
    # python-telegram-bot's base_url meaning: the token is appended to it.
    api_base_url: str = "https://api.telegram.org/bot"
    # python-telegram-bot's base_file_url: where getFile's paths are downloaded from (the
    # token is appended to it, like api_base_url).
    file_base_url: str = "https://api.telegram.org/file/bot"
    poll_timeout_s: Annotated[int, Field(ge=0, le=60)] = 30
    # Webhook mode instead of long polling: Telegram POSTs every update to this https
    # address (a reverse proxy ending TLS in front of webhook_listen, where the daemon's own
    # server listens); each POST must carry the secret named by webhook_secret_env. Every
    # replica listens; only the serving one registers the address (setWebhook).
    webhook_url: str | None = None
    webhook_listen: str | None = None
    webhook_secret_env: str | None = None

    @field_validator("webhook_url")
    @classmethod
    def _webhook_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if not parts.hostname or parts.scheme not in ("http", "https"):
            raise ValueError("must be an https:// address, e.g. https://bot.example.com/telegram")
        if parts.scheme == "http" and not is_loopback(parts.hostname):
            raise ValueError(
                "must be https:// (Telegram delivers only over TLS); http:// is allowed only "
                "for 127.0.0.1 or localhost"
            )
        if parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError("must be scheme, host, port and path only (no query, fragment, user)")
        return value

    @field_validator("webhook_listen")
    @classmethod
    def _webhook_listen(cls, value: str | None) -> str | None:
        if value is not None:
            split_host_port(value)
        return value

    @model_validator(mode="after")
    def _webhook_complete(self) -> TelegramConfig:
        if self.webhook_url is None:
            if self.webhook_listen is not None or self.webhook_secret_env is not None:
                raise ValueError(
                    "webhook_listen and webhook_secret_env need webhook_url (without it, "
                    "the bot polls)"
                )
            return self
        if not self.webhook_secret_env:
            raise ValueError("webhook_secret_env is required with webhook_url")
        if self.webhook_listen is None:
            raise ValueError(
                "webhook_listen (host:port of the server behind the proxy) is required with "
                "webhook_url"
            )
        return self

    @property
    def webhook_path(self) -> str:
        """The path Telegram's POSTs arrive on (the proxy passes it through as it is)."""
        return urlsplit(self.webhook_url or "").path or "/"


# Telegram's rule for setWebhook's secret_token.
TELEGRAM_SECRET = re.compile(r"[A-Za-z0-9_-]{1,256}")


class SlackConfig(_ChannelBase):
    bot_token_env: str = "SLACK_BOT_TOKEN"
    app_token_env: str = "SLACK_APP_TOKEN"
    # slack_sdk's base_url meaning; the trailing slash matters.
    api_base_url: str = "https://slack.com/api/"

    @field_validator("api_base_url")
    @classmethod
    def _slash(cls, value: str) -> str:
        if not value.endswith("/"):
            raise ValueError("must end with / (slack_sdk joins paths onto it)")
        return value


class DiscordConfig(_ChannelBase):
    token_env: str = "DISCORD_BOT_TOKEN"
    # discord.py's Route.BASE meaning.
    api_base_url: str = "https://discord.com/api/v10"
    gateway_url: str = "wss://gateway.discord.gg/"


class ChannelsConfig(_Strict):
    telegram: TelegramConfig | None = None
    slack: SlackConfig | None = None
    discord: DiscordConfig | None = None


class BindingConfig(_Strict):
    platform: Literal["telegram", "slack", "discord"]
    channel: Annotated[str, Field(min_length=1)]
    session: Annotated[str, Field(min_length=1, max_length=200)]
    # channel: one session; thread: each Slack thread / Telegram topic is "<session>/<thread>".
    scope: Literal["channel", "thread"] = "channel"
    # Platform user ids; ["*"] is anyone in the channel; empty is nobody.
    allowed_users: tuple[str, ...] = ()
    require_mention: bool = False
    tools: tuple[str, ...] = ()
    # Tools that may run unattended even though they would need approval.
    preapproved: tuple[str, ...] = ()
    time_budget_s: Annotated[float, Field(gt=0, le=86_400)] | None = None
    # Platform user ids who may approve this binding's tool calls with the card's buttons;
    # empty (the default) is nobody, and a call that needs approval is refused as before.
    approvers: tuple[Annotated[str, Field(min_length=1, max_length=64)], ...] = ()
    # An unanswered card is a denial after this long (the turn waits outside its budget).
    approval_timeout_s: Annotated[float, Field(ge=5, le=7 * 86_400)] = 900.0
    # Edit one message as the answer arrives.
    stream: bool = True
    # Accept files and images from users (checked, stored once by content hash, shown to the
    # model by reference), each up to this size; larger ones are refused before any download.
    attachments: bool = True
    max_attachment_mb: Annotated[float, Field(gt=0, le=2000)] = 20.0
    # Threads of one project may read and send into each other with Thread Relay (relay/);
    # absent, the binding is a project of its own (its session id), so nothing is shared.
    project: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    # Tokens this binding's turns (and the runs of jobs made in its chat) may spend per UTC
    # day; None or 0: no limit of its own.
    daily_tokens: Annotated[int, Field(ge=0)] | None = None
    # Voice notes become the turn's text; None: on when [voice] can transcribe.
    voice: bool | None = None
    # Answers spoken too (the text always goes): to voice notes, to everything, or never.
    voice_replies: Literal["never", "when_spoken_to", "always"] = "never"

    @property
    def project_name(self) -> str:
        return self.project if self.project is not None else self.session

    @field_validator("approvers")
    @classmethod
    def _no_wildcard_approver(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # Unlike allowed_users, approving is never "anyone": a name must be listed.
        if "*" in value:
            raise ValueError("approvers lists user ids; '*' (anyone) is not allowed here")
        return value

    @model_validator(mode="after")
    def _preapproved_listed(self) -> BindingConfig:
        missing = [t for t in self.preapproved if t not in self.tools]
        if missing:
            raise ValueError(f"preapproved tools must also be in tools: {', '.join(missing)}")
        return self


class PairingConfig(_Strict):
    """DM pairing (chat/pairing.py): a person no binding allows who writes to the bot gets a
    one-time code, and an operator's approval of it (``geodebot pairing approve``) makes a
    binding in the store. Pairing changes who may talk to the bot, never what a session may
    do: what an approval grants is this table's, the same for every person paired."""

    # Absent table: off. ``geodebot init`` writes it on.
    enabled: bool = False
    # The platforms it is on for; empty: every enabled platform.
    platforms: tuple[Literal["telegram", "slack", "discord"], ...] = ()
    # A code not approved within this long is void; the person may ask again after it.
    code_ttl_s: Annotated[float, Field(ge=60, le=30 * 86_400)] = 3600.0
    # Requests waiting at once per platform; more strangers get no code until some are
    # decided or expire (a flood of them costs one short reply each, at most this many).
    max_pending: Annotated[int, Field(ge=1, le=1000)] = 10
    # False: only direct messages pair. True: a message in a group no binding has pairs the
    # group for its sender (who alone may then talk to the bot there, by mention).
    groups: bool = False
    # What an approved pairing's binding may use; by default no tools at all.
    tools: tuple[str, ...] = ()
    preapproved: tuple[str, ...] = ()
    # Who may approve its tool calls in the chat; "self" stands for the person paired.
    approvers: tuple[Annotated[str, Field(min_length=1, max_length=64)], ...] = ()
    time_budget_s: Annotated[float, Field(gt=0, le=86_400)] | None = None
    daily_tokens: Annotated[int, Field(ge=0)] | None = None
    # The project paired chats share (Thread Relay); None: each is a project of its own.
    project: Annotated[str, Field(min_length=1, max_length=200)] | None = None

    @field_validator("approvers")
    @classmethod
    def _no_wildcard_approver(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if "*" in value:
            raise ValueError("approvers lists user ids or 'self'; '*' (anyone) is not allowed")
        return value

    @model_validator(mode="after")
    def _preapproved_listed(self) -> PairingConfig:
        missing = [t for t in self.preapproved if t not in self.tools]
        if missing:
            raise ValueError(f"preapproved tools must also be in tools: {', '.join(missing)}")
        return self

    def on_for(self, platform: str) -> bool:
        return self.enabled and (not self.platforms or platform in self.platforms)


_AUDIO_SUFFIXES = ("/audio/transcriptions", "/audio/speech")


def _audio_base(value: str | None) -> str | None:
    """An OpenAI-compatible audio URL as the SDK's base URL (ending in /v1, say): the
    endpoint's own path, if given, is taken off."""
    if value is None or value == "":
        return None
    if not value.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://")
    base = value.rstrip("/")
    for suffix in _AUDIO_SUFFIXES:
        base = base.removesuffix(suffix)
    return base


class VoiceConfig(_Strict):
    """Voice notes in and spoken answers out (chat/voice.py), through OpenAI-compatible
    audio services: OpenAI, Groq, or a local server such as faster-whisper-server or
    LocalAI. A voice note becomes the turn's text; an answer may go as speech too."""

    # /v1/audio/transcriptions (or the /v1 base it is under). None: no service, and voice
    # notes are transcribed only with local_model_dir.
    transcribe_url: str | None = None
    transcribe_model: Annotated[str, Field(min_length=1)] = "whisper-1"
    # The environment variable with the services' key; None: none sent (a local server).
    api_key_env: str | None = None
    # Longer notes (by the length the platform announces) are refused before any download.
    max_seconds: Annotated[float, Field(gt=0, le=4 * 3600)] = 300.0
    # ISO-639-1 language of what is said; None: the service detects it.
    language: Annotated[str, Field(min_length=2, max_length=12)] | None = None
    # /v1/audio/speech (or its /v1 base); None: no spoken answers.
    speech_url: str | None = None
    speech_model: Annotated[str, Field(min_length=1)] = "tts-1"
    speech_voice: Annotated[str, Field(min_length=1)] = "alloy"
    # An answer is spoken up to this many characters; a longer one says it was cut.
    max_speech_chars: Annotated[int, Field(ge=50, le=4096)] = 1500
    # US dollars per transcribed minute and per million spoken characters, for
    # `geodebot usage` and [model] daily_usd.
    price_per_minute: Annotated[float, Field(ge=0, le=100)] | None = None
    price_per_mchars: Annotated[float, Field(ge=0, le=10_000)] | None = None
    # A faster-whisper model on this machine (the faster-whisper extra); it is never
    # downloaded at run time. Used instead of transcribe_url.
    local_model_dir: Path | None = None
    request_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    # The SDK's own retries of a 429 or 5xx; after them the message waits as a dead letter.
    max_retries: Annotated[int, Field(ge=0, le=10)] = 2

    @field_validator("transcribe_url", "speech_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return _audio_base(value)

    @property
    def transcribes(self) -> bool:
        return self.transcribe_url is not None or self.local_model_dir is not None

    @property
    def speaks(self) -> bool:
        return self.speech_url is not None


MemoryOrigin = Literal["chat", "relay", "job", "terminal"]


class MemoryConfig(_Strict):
    """Project memory (memory/): the memory_save, memory_search and memory_forget tools
    over items kept per project (the bindings' ``project``, as Thread Relay's)."""

    # False: the tools refuse every call (what was saved stays).
    enabled: bool = True
    # A save past this many items of a project is refused (nothing is evicted).
    max_items: Annotated[int, Field(ge=1, le=1_000_000)] = 5000
    max_item_chars: Annotated[int, Field(ge=20, le=20_000)] = 2000
    # Where saves may come from: a person's own message (chat), a turn answering a relayed
    # ask (relay), a scheduled job (job), the terminal.
    save_from: tuple[MemoryOrigin, ...] = ("chat", "relay", "job", "terminal")
    # Items recalled into the prompt before each model call of a chat turn (0: none).
    recall: Annotated[int, Field(ge=0, le=20)] = 0
    recall_max_tokens: Annotated[int, Field(ge=50, le=8000)] = 800


class RelayConfig(_Strict):
    """Thread Relay (relay/): what a session may read of other threads of its project, and
    how sends into them are bounded. The tools themselves are listed per binding."""

    # False blocks new deliveries; receipts and what was delivered stay.
    enabled: bool = True
    # One read returns at most this many messages and characters of message text.
    max_read_messages: Annotated[int, Field(ge=1, le=100)] = 20
    max_read_chars: Annotated[int, Field(ge=200, le=50_000)] = 8_000
    # A send is based on the session's last read of the target: its revision, its active
    # turn, its capability revision. After this long the read is too old to send on (the
    # envelope expires) and the thread must be read again.
    envelope_ttl_s: Annotated[float, Field(ge=1, le=86_400)] = 600.0
    # Deliveries from one thread whose target has not yet taken them (posted, answered).
    max_in_flight: Annotated[int, Field(ge=1, le=4)] = 4
    # The longest message a send may carry.
    max_send_chars: Annotated[int, Field(ge=1, le=16_000)] = 4_000
    # The project of terminal chats (geodebot chat), whose user is the person at the
    # terminal; None: the terminal takes no part in Thread Relay.
    terminal_project: Annotated[str, Field(min_length=1, max_length=200)] | None = None


class Config(_Strict):
    daemon: DaemonConfig = DaemonConfig()
    model: ModelConfig = ModelConfig()
    budgets: BudgetConfig = BudgetConfig()
    prompt: PromptConfig = PromptConfig()
    tools: ToolsConfig = ToolsConfig()
    hooks: tuple[HookConfig, ...] = ()
    mcp: MCPConfig = MCPConfig()
    channels: ChannelsConfig = ChannelsConfig()
    bindings: tuple[BindingConfig, ...] = ()
    jobs: tuple[JobConfig, ...] = ()
    relay: RelayConfig = RelayConfig()
    store: StoreConfig = StoreConfig()
    pairing: PairingConfig = PairingConfig()
    voice: VoiceConfig | None = None
    memory: MemoryConfig = MemoryConfig()
    # Where the file was read from; relative paths in it are resolved against its folder.
    source: Path | None = Field(default=None, exclude=True)
    # The sha256 of the file's bytes as read ("" when not read from a file).
    digest: str = Field(default="", exclude=True)

    @property
    def state_dir(self) -> Path:
        """``$STATE_DIRECTORY`` (systemd's StateDirectory=) wins over the file's setting."""
        env = os.environ.get("STATE_DIRECTORY")
        if env:
            # systemd may pass several colon-separated directories; the first is ours.
            return Path(env.split(":")[0])
        return self._relative(self.daemon.state_dir)

    def _relative(self, path: Path) -> Path:
        if path.is_absolute() or self.source is None:
            return path
        return self.source.parent / path

    # The files the daemon keeps in its state directory.
    @property
    def db_path(self) -> Path:
        """The SQLite store's file (unused when [store] url names a PostgreSQL database)."""
        return self.state_dir / DB_FILE

    @property
    def ledger_path(self) -> Path:
        return self.state_dir / LEDGER_FILE

    @property
    def files_dir(self) -> Path:
        """Files users sent and files sent to them, kept once by content hash."""
        return self.state_dir / FILES_DIR

    @property
    def socket_path(self) -> Path:
        """The local chat socket of ``geodebot chat`` and ``geodebot status``."""
        return self.state_dir / SOCKET_FILE

    @property
    def trust_path(self) -> Path:
        """Which project MCP files the operator trusted (``geodebot mcp trust``)."""
        return self.state_dir / TRUST_FILE

    def prompt_file(self, path: Path) -> Path:
        return self._relative(path)

    @property
    def voice_model_dir(self) -> Path | None:
        """[voice] local_model_dir, relative to the file's folder."""
        if self.voice is None or self.voice.local_model_dir is None:
            return None
        return self._relative(self.voice.local_model_dir)

    @model_validator(mode="after")
    def _bindings_unique(self) -> Config:
        seen: set[tuple[str, str]] = set()
        for binding in self.bindings:
            key = (binding.platform, binding.channel)
            if key in seen:
                raise ValueError(f"bindings: {binding.platform} channel {binding.channel} twice")
            seen.add(key)
        projects: dict[str, str] = {}
        for index, binding in enumerate(self.bindings):
            # A thread belongs to one project, whichever of its bindings is asked.
            first = projects.setdefault(binding.session, binding.project_name)
            if first != binding.project_name:
                raise ValueError(
                    f"bindings.{index}.project: session {binding.session!r} is bound in "
                    f"project {first!r} already; bindings sharing a session share its project"
                )
        return self

    @model_validator(mode="after")
    def _voice_configured(self) -> Config:
        voice = self.voice
        for index, binding in enumerate(self.bindings):
            if binding.voice and (voice is None or not voice.transcribes):
                raise ValueError(
                    f"bindings.{index}.voice: needs [voice] transcribe_url or local_model_dir"
                )
            if binding.voice_replies != "never" and (voice is None or not voice.speaks):
                raise ValueError(f"bindings.{index}.voice_replies: needs [voice] speech_url")
        return self

    @model_validator(mode="after")
    def _jobs_deliverable(self) -> Config:
        sessions = {binding.session for binding in self.bindings}
        ids: set[str] = set()
        for index, job in enumerate(self.jobs):
            if job.id in ids:
                raise ValueError(f"jobs.{index}.id: {job.id!r} twice")
            ids.add(job.id)
            if job.deliver_to not in sessions:
                raise ValueError(
                    f"jobs.{index}.deliver_to: {job.deliver_to!r} is not the session of a binding"
                )
        return self

    @property
    def workspace(self) -> Path:
        return self._relative(self.tools.workspace)

    @property
    def enabled_platforms(self) -> frozenset[str]:
        """The platforms whose channel table is present and enabled."""
        ch = self.channels
        tables = (("telegram", ch.telegram), ("slack", ch.slack), ("discord", ch.discord))
        return frozenset(name for name, t in tables if t is not None and t.enabled)

    @property
    def project_mcp_config(self) -> Path | None:
        path = self.mcp.project_config
        return None if path is None else self._relative(path)


def _describe(err: ErrorDetails) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        return f"{loc}: unknown key"
    if kind == "literal_error":
        expected = str(ctx.get("expected", "")).replace("'", "").replace(" or ", ", ")
        return f"{loc}: must be one of {expected}"
    if kind == "missing":
        return f"{loc}: required"
    msg = err["msg"]
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


def parse_config(
    data: Mapping[str, Any], *, source: Path | None = None, digest: str = ""
) -> Config:
    try:
        config = Config.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(str(source or "<config>"), [_describe(e) for e in exc.errors()]) from None
    return config.model_copy(update={"source": source, "digest": digest})


def load_config(path: Path) -> Config:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(str(path), ["file not found"]) from None
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read: {exc.strerror}"]) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(str(path), ["not UTF-8 text"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), [f"invalid TOML: {exc}"]) from None
    digest = hashlib.sha256(raw).hexdigest()
    return parse_config(data, source=path.resolve(), digest=digest)


def config_path(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env)
    return DEFAULT_CONFIG_PATH


def resolve_secret(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The secret named ``name``: the environment variable, else the systemd credential.

    An empty value counts as missing, so ``FOO=`` in an env file does not pass for a key.
    """
    env = os.environ if environ is None else environ
    value = env.get(name)
    if value:
        return value.strip()
    creds = env.get("CREDENTIALS_DIRECTORY")
    if creds:
        path = Path(creds) / name
        try:
            text = path.read_text(encoding="utf-8").strip()
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            return None
        return text or None
    return None


def secret_names(config: Config) -> Iterable[str]:
    yield config.model.key_env
    if config.daemon.http_token_env:
        yield config.daemon.http_token_env
    for fb in config.model.fallbacks:
        yield fb.key_env
    if config.store.password_env:
        yield config.store.password_env
    if config.voice is not None and config.voice.api_key_env:
        yield config.voice.api_key_env
    yield from channel_secret_names(config)


def channel_secret_names(config: Config) -> Iterable[str]:
    """The secrets of the enabled channels (each is required at startup)."""
    ch = config.channels
    if ch.telegram is not None and ch.telegram.enabled:
        yield ch.telegram.token_env
        if ch.telegram.webhook_secret_env:
            yield ch.telegram.webhook_secret_env
    if ch.slack is not None and ch.slack.enabled:
        yield ch.slack.bot_token_env
        yield ch.slack.app_token_env
    if ch.discord is not None and ch.discord.enabled:
        yield ch.discord.token_env
