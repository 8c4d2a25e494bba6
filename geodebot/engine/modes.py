"""Session modes: who is on the other end, and what that rules out."""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    # Channel messages and scheduled jobs: nobody can approve anything.
    DAEMON = "daemon"
    # `geodebot chat` over the local socket: a person at a terminal can approve.
    IPC = "ipc"
    # `geodebot run` and MCP `run_agent`: one-shot, nobody to ask.
    HEADLESS = "headless"


# Tools no unattended mode may ever have. `computer` may come back in DAEMON through the
# operator switch when the binding or job lists it; HEADLESS has no exception.
UNATTENDED_DENY: frozenset[str] = frozenset({"run_bash", "delegate_task", "computer"})


def denied_tools(mode: Mode) -> frozenset[str]:
    if mode is Mode.IPC:
        return frozenset()
    return UNATTENDED_DENY
