"""Where a session's tools come from: the static registry and dynamic sources (MCP servers).

A dynamic source is asked only for the tools a session's allowlist names with its prefix, so
MCP servers start lazily, on first use, not at daemon start, and only the servers of the
tools a session lists are started for it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Protocol

from geodebot.engine.tools.registry import ToolRegistry
from geodebot.engine.tools.spec import ToolSpec

log = logging.getLogger(__name__)


class ToolSource(Protocol):
    """Tools discovered at run time, e.g. the declared tools of the MCP servers."""

    async def tool_specs(
        self, names: Collection[str], *, deadline: float | None = None, patient: bool = False
    ) -> list[ToolSpec]:
        """The specs of those of ``names`` that exist (others are simply absent).

        ``deadline`` is when the turn that asks must end, on the event loop's clock: a source
        waits for nothing past a small share of what is left until then. ``patient``: the
        specs must be the real ones if at all possible (a session recovering a batch whose
        approvals were given under them), so a source waits up to half of what is left."""
        ...


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

    async def resolve(
        self, names: Iterable[str], *, deadline: float | None = None, patient: bool = False
    ) -> Mapping[str, ToolSpec]:
        """The specs of ``names`` that exist now; unknown names are simply absent.

        ``deadline`` and ``patient``: see :meth:`ToolSource.tool_specs`."""
        wanted = set(names)
        found: dict[str, ToolSpec] = {}
        for name in wanted:
            spec = self._registry.get(name)
            if spec is not None:
                found[name] = spec
        for prefix, source in self._sources.items():
            asked = {name for name in wanted - found.keys() if name.startswith(prefix)}
            if not asked:
                continue
            try:
                specs = await source.tool_specs(asked, deadline=deadline, patient=patient)
            except Exception:
                # A broken source costs its own tools, never the session.
                log.exception("tool source %s failed", prefix)
                continue
            found.update({s.name: s for s in specs if s.name in asked})
        return found
