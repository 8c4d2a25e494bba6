"""The BoundToolPlan: the immutable set of tools one session may see and call.

Projected once per session from the registry, the mode's deny list, the binding's or job's
allowlist, the operator's pre-authorisations and the computer-use switch. Deny by default: a
tool that is not listed is not in the plan, and an empty allowlist means no tools at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from geodebot.engine.llm.types import ToolSchema, canonical_json
from geodebot.engine.modes import Mode, denied_tools
from geodebot.engine.tools.spec import ToolSpec

COMPUTER = "computer"


@dataclass(frozen=True, slots=True)
class BoundToolPlan:
    mode: Mode
    tools: Mapping[str, ToolSpec]
    # Tools the operator listed as pre-authorised: in DAEMON and HEADLESS, where nobody can
    # approve, these are the only tools that may run when approval would be needed.
    preapproved: frozenset[str]
    generation: int
    content_hash: str

    @staticmethod
    def project(
        tools: Mapping[str, ToolSpec],
        mode: Mode,
        allowlist: Iterable[str],
        *,
        preapproved: Iterable[str] = (),
        computer_use: bool = False,
        generation: int = 1,
    ) -> BoundToolPlan:
        """``tools`` is every tool that exists (the registry); the rest narrows it."""
        deny = set(denied_tools(mode))
        if mode is Mode.DAEMON and computer_use:
            # The operator switch is on: computer comes back, but only where it is listed.
            deny.discard(COMPUTER)
        chosen: dict[str, ToolSpec] = {}
        for name in sorted(set(allowlist)):
            spec = tools.get(name)
            if spec is not None and name not in deny:
                chosen[name] = spec
        approved = frozenset(preapproved) & chosen.keys()
        fingerprint = {
            "mode": mode.value,
            "generation": generation,
            "tools": [spec.fingerprint() for spec in chosen.values()],
            "preapproved": sorted(approved),
        }
        digest = hashlib.sha256(canonical_json(fingerprint).encode()).hexdigest()
        return BoundToolPlan(mode, MappingProxyType(chosen), approved, generation, digest)

    def schemas(self) -> tuple[ToolSchema, ...]:
        return tuple(spec.schema() for spec in self.tools.values())

    def get(self, name: str) -> ToolSpec | None:
        return self.tools.get(name)


def allowlist_problems(mode: Mode, names: Iterable[str], known: Iterable[str]) -> list[str]:
    """Config checks for a binding's or job's tool list (one message per problem)."""
    known_set = set(known)
    problems = []
    for name in names:
        # computer may be listed for DAEMON: the operator switch decides at run time.
        if name in denied_tools(mode) and not (name == COMPUTER and mode is Mode.DAEMON):
            problems.append(f"{name}: never available in {mode.value} mode")
        elif name not in known_set and not name.startswith("mcp__"):
            problems.append(f"{name}: no such tool")
    return problems
