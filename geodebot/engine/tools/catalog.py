"""Where a session's tools come from: the static registry and dynamic sources (MCP servers).

A dynamic source is asked only when a session's allowlist names one of its tools, so MCP
servers start lazily, on first use, not at daemon start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Protocol

from geodebot.engine.tools.registry import ToolRegistry
from geodebot.engine.tools.spec import ToolSpec

log = logging.getLogger(__name__)


class ToolSource(Protocol):
    """Tools discovered at run time, e.g. the declared tools of the MCP servers."""

    async def tool_specs(self) -> list[ToolSpec]: ...


class ToolCatalog:
    """``sources`` maps a name prefix (``mcp__``) to the source whose tools carry it."""

    def __init__(
        self, registry: ToolRegistry, sources: Mapping[str, ToolSource] | None = None
    ) -> None:
        self._registry = registry
        self._sources = dict(sources or {})

    @property
    def registry(self) -> ToolRegistry:
        return self._registry

    async def resolve(self, names: Iterable[str]) -> Mapping[str, ToolSpec]:
        """The specs of ``names`` that exist now; unknown names are simply absent."""
        wanted = set(names)
        found: dict[str, ToolSpec] = {}
        for name in wanted:
            spec = self._registry.get(name)
            if spec is not None:
                found[name] = spec
        for prefix, source in self._sources.items():
            if not any(name.startswith(prefix) for name in wanted - found.keys()):
                continue
            try:
                specs = await source.tool_specs()
            except Exception:
                # A broken source costs its own tools, never the session.
                log.exception("tool source %s failed", prefix)
                continue
            found.update({s.name: s for s in specs if s.name in wanted and s.name not in found})
        return found
