"""The tools geodebot ships with, configured by one :class:`BuiltinSettings`."""

from __future__ import annotations

from geodebot.engine.tools.builtin.bash import bash_tool
from geodebot.engine.tools.builtin.computer import computer_tool
from geodebot.engine.tools.builtin.files import file_tools
from geodebot.engine.tools.builtin.http import http_get_tool
from geodebot.engine.tools.builtin.settings import BuiltinSettings
from geodebot.engine.tools.registry import GET_TIME
from geodebot.engine.tools.spec import ToolSpec


def builtin_tools(settings: BuiltinSettings) -> list[ToolSpec]:
    return [
        GET_TIME,
        *file_tools(settings),
        http_get_tool(settings),
        bash_tool(settings),
        computer_tool(settings.computer_socket),
    ]


__all__ = ["BuiltinSettings", "builtin_tools"]
