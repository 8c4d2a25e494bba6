"""Which project config files the operator has vouched for, pinned to their exact content.

A project's MCP servers run commands on this machine, so a file that merely sits in a
workspace must not be enough to start them: the operator runs ``geodebot config trust PATH``,
which records the sha256 of the content, and any later edit (by anyone) withdraws the trust
until the operator looks again. The main config is trusted by being the main config.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import tomli as tomllib
from pydantic import ValidationError

from geodebot.config.schema import ConfigError, MCPConfig, MCPServerConfig, _describe

log = logging.getLogger(__name__)

_FORMAT_VERSION = 1
_PROJECT_KEYS = frozenset({"servers"})


@dataclass(frozen=True, slots=True)
class TrustEntry:
    path: str
    sha256: str
    by: str
    at: str


def _digest(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def parse_project_servers(content: bytes, *, source: str) -> list[MCPServerConfig]:
    """The ``[[servers]]`` of a project file; raises :class:`ConfigError` naming each problem."""
    try:
        data = tomllib.loads(content.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(source, ["not UTF-8 text"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, [f"invalid TOML: {exc}"]) from None
    # A project may declare servers and nothing else: in particular it cannot point at
    # yet another project file and so chain trust onwards.
    problems = [f"{key}: unknown key" for key in sorted(set(data) - _PROJECT_KEYS)]
    try:
        servers = MCPConfig.model_validate({"servers": data.get("servers", [])}).servers
    except ValidationError as exc:
        problems.extend(_describe(err) for err in exc.errors())
        servers = ()
    if problems:
        raise ConfigError(source, problems)
    return list(servers)


class TrustStore:
    """A small JSON file (``<state_dir>/trust.json``), replaced atomically, mode 0600."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def trust(self, config_path: Path, *, by: str) -> TrustEntry:
        """Pin the file's current content; raises ConfigError if it is not a valid project file."""
        resolved = config_path.resolve()
        content = resolved.read_bytes()
        # Trusting a file the daemon would reject anyway only defers the operator's surprise.
        parse_project_servers(content, source=str(resolved))
        entry = TrustEntry(
            path=str(resolved),
            sha256=_digest(content),
            by=by,
            at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        entries = {e.path: e for e in self._load()}
        entries[entry.path] = entry
        self._save(entries.values())
        log.info("trusted %s (sha256 %s) by %s", entry.path, entry.sha256, by)
        return entry

    def revoke(self, config_path: Path) -> bool:
        """Forget the file; False when it was not trusted in the first place."""
        key = str(config_path.resolve())
        entries = {e.path: e for e in self._load()}
        if entries.pop(key, None) is None:
            return False
        self._save(entries.values())
        log.info("revoked trust in %s", key)
        return True

    def entry(self, config_path: Path) -> TrustEntry | None:
        key = str(config_path.resolve())
        return next((e for e in self._load() if e.path == key), None)

    def is_trusted(self, config_path: Path) -> bool:
        entry = self.entry(config_path)
        if entry is None:
            return False
        try:
            content = config_path.resolve().read_bytes()
        except OSError:
            return False
        return _digest(content) == entry.sha256

    def entries(self) -> list[TrustEntry]:
        return sorted(self._load(), key=lambda e: e.path)

    def _load(self) -> list[TrustEntry]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        try:
            data = json.loads(raw)
            return [TrustEntry(**item) for item in data["entries"]]
        except (ValueError, KeyError, TypeError) as exc:
            # Failing closed: an unreadable store trusts nothing, and the next `trust`
            # rewrites it from scratch.
            log.warning("ignoring unreadable trust store %s: %s", self.path, exc)
            return []

    def _save(self, entries: Iterable[TrustEntry]) -> None:
        body = {
            "version": _FORMAT_VERSION,
            "entries": [asdict(e) for e in sorted(entries, key=lambda e: e.path)],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # mkstemp creates the file 0600, so the content is never readable by others, not
        # even for the moment before the rename.
        fd, tmp = tempfile.mkstemp(prefix=".trust-", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(body, handle, indent=2)
                handle.write("\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(self.path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_project_servers(path: Path, trust: TrustStore) -> tuple[list[MCPServerConfig], str | None]:
    """The project file's servers, or ``([], why they are ignored)``.

    The content is read once and that same content is both checked against the pinned
    hash and parsed, so an edit racing the check cannot slip through.
    """
    resolved = path.resolve()
    try:
        content = resolved.read_bytes()
    except OSError as exc:
        return [], f"{path}: cannot read project MCP config ({exc.strerror or exc})"
    entry = trust.entry(resolved)
    if entry is None:
        return [], (
            f"{path} is not trusted; its MCP servers are ignored until an operator runs "
            f"`geodebot config trust {path}`"
        )
    if _digest(content) != entry.sha256:
        return [], (
            f"{path} changed since {entry.by} trusted it at {entry.at}; its MCP servers are "
            f"ignored until it is reviewed and trusted again"
        )
    try:
        servers = parse_project_servers(content, source=str(path))
    except ConfigError as exc:
        return [], f"{path} is trusted but invalid: " + "; ".join(exc.problems)
    return servers, None
