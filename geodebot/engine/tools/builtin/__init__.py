"""The tools geodebot ships with, configured by one :class:`BuiltinSettings`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from geodebot.engine.tools.builtin.bash import bash_tool
from geodebot.engine.tools.builtin.computer import computer_tool
from geodebot.engine.tools.builtin.files import file_tools
from geodebot.engine.tools.builtin.http import http_get_tool
from geodebot.engine.tools.registry import GET_TIME
from geodebot.engine.tools.spec import ToolSpec


@dataclass(frozen=True)
class BuiltinSettings:
    workspace: Path
    # Exact hosts, or "*.example.com" for its subdomains (not example.com itself).
    http_allow_hosts: tuple[str, ...] = ()
    http_allow_private: bool = False
    http_max_bytes: int = 1_000_000
    http_timeout_s: float = 20.0
    bash_timeout_s: float = 60.0
    computer_socket: Path | None = None


def builtin_tools(settings: BuiltinSettings) -> list[ToolSpec]:
    return [
        GET_TIME,
        *file_tools(settings),
        http_get_tool(settings),
        bash_tool(settings),
        computer_tool(settings.computer_socket),
    ]


__all__ = ["BuiltinSettings", "builtin_tools"]
