"""Reading the config file again without a restart (SIGHUP, the unit's ``ExecReload=``).

What a reload changes: the bindings (swapped whole in the one ``BindingIndex``), their
tools and budgets, ``[budgets]``, the spend limits, ``[[jobs]]`` (synced into the store, which
the scheduler follows), ``[pairing]`` and ``[daemon] log_level``. A file that does not
validate, or names a tool or job the daemon cannot have, is refused whole: the config in
force stays, and each problem is logged naming its key. What only a restart can change
(the state directory, the store, the HTTP address, the channels and their tokens, the model
and MCP servers, the tools' settings, ...) is named in the log when it differs, and keeps its
old value meanwhile. Turns already admitted keep the binding, and so the plan, they started
with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geodebot.app.build import App, check_tool_lists, spend_limits
from geodebot.chat.pairing import PairingDesk
from geodebot.config.schema import Config, ConfigError, load_config
from geodebot.scheduler.definitions import check_jobs, config_jobs
from geodebot.store.protocol import JobStore

__all__ = ["RELOADABLE", "ConfigInForce", "ConfigReloader", "restart_only_changes"]

log = logging.getLogger(__name__)

# The keys a reload applies; every other difference waits for a restart.
RELOADABLE = frozenset({"bindings", "jobs", "pairing", "budgets", "daemon.log_level"})


@dataclass(slots=True)
class ConfigInForce:
    """The config the daemon runs with, as ``geodebot status`` shows it: its file's
    content hash and when it was read. Changed only by a reload that was applied."""

    config: Config
    loaded_at: float

    @property
    def digest(self) -> str:
        return self.config.digest

    def facts(self) -> dict[str, Any]:
        return {
            "path": str(self.config.source or ""),
            "sha256": self.digest,
            "loaded_at": round(self.loaded_at, 3),
        }


def _flat(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key in sorted(value):
            yield from _flat(value[key], f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def restart_only_changes(old: Config, new: Config) -> list[str]:
    """The keys whose value differs between ``old`` and ``new`` that a reload does not
    apply, named as in the file (``channels.telegram.token_env``)."""
    before = dict(_flat(old.model_dump(mode="json"), ""))
    after = dict(_flat(new.model_dump(mode="json"), ""))
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return [
        key for key in changed if not any(key == r or key.startswith(r + ".") for r in RELOADABLE)
    ]


class ConfigReloader:
    """One per daemon. :meth:`reload` reads the file again and applies what it may; reloads
    run one at a time (a second SIGHUP during one waits for it)."""

    def __init__(
        self,
        app: App,
        in_force: ConfigInForce,
        *,
        pairing: PairingDesk,
        jobs: JobStore,
        on_applied: Callable[[Config], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._app = app
        self._in_force = in_force
        self._pairing = pairing
        self._jobs = jobs
        self._on_applied = on_applied
        self._clock = clock
        self._lock = asyncio.Lock()
        self.reloads = 0
        self.refused = 0

    async def reload(self) -> bool:
        """Whether the file was applied; a refusal is logged with its reasons."""
        async with self._lock:
            old = self._in_force.config
            path = old.source
            if path is None:
                log.error("config reload: the daemon's config was not read from a file")
                self.refused += 1
                return False
            try:
                new = load_config(Path(path))
                check_tool_lists(new, self._app.services.tools.registry)
                check_jobs(new, self._app.services.tools.registry.names())
            except ConfigError as exc:
                self.refused += 1
                for problem in exc.problems:
                    log.error("config reload refused, the config in force stays: %s", problem)
                return False
            if new.digest == old.digest:
                log.info("config reload: %s is unchanged (sha256 %s)", path, new.digest[:12])
                self._in_force.loaded_at = self._clock()
                return True
            await self._apply(old, new)
            self.reloads += 1
            return True

    async def _apply(self, old: Config, new: Config) -> None:
        for key in restart_only_changes(old, new):
            log.warning("config reload: %s changed; it takes effect after a restart", key)
        app = self._app
        # Jobs first: a failed sync leaves the rest as it was, and is logged.
        await self._jobs.jobs_sync_config(config_jobs(new))
        app.bindings.replace(config=new.bindings)
        app.services.budgets = new.budgets
        if app.services.spend is not None:
            app.services.spend.limits = spend_limits(new)
        self._pairing.reconfigure(new.pairing)
        if new.daemon.log_level != old.daemon.log_level:
            logging.getLogger().setLevel(new.daemon.log_level.upper())
        # Everything that restart-only keys keep: the config in force is the old one with
        # the reloaded parts of the new.
        applied = old.model_copy(
            update={
                "bindings": new.bindings,
                "jobs": new.jobs,
                "pairing": new.pairing,
                "budgets": new.budgets,
                "daemon": old.daemon.model_copy(update={"log_level": new.daemon.log_level}),
                "digest": new.digest,
            }
        )
        self._in_force.config = applied
        self._in_force.loaded_at = self._clock()
        if self._on_applied is not None:
            self._on_applied(applied)
        log.info(
            "config reloaded from %s (sha256 %s): %d bindings, %d jobs, pairing %s",
            new.source,
            new.digest[:12],
            len(new.bindings),
            len(new.jobs),
            "on" if new.pairing.enabled else "off",
        )
