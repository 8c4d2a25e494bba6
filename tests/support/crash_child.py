"""Runs one DAEMON turn and SIGKILLs its own process at a chosen lifecycle event.

Used by the crash tests as ``python -m tests.support.crash_child CONFIG_JSON MARKER EVENT TOOL
[TURN_ID]``: the kill is a real ``kill -9`` of the whole process, so nothing after that point
runs, not even ``finally`` blocks. EVENT "none" leaves the killing to the tool itself
(``write_and_die``). TURN_ID names the turn, as the chat router names an inbox row's.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from geodebot.config.schema import parse_config
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec
from tests.support.app import open_app


async def main(
    config_json: str, marker: str, event: str, tool: str, turn_id: str | None = None
) -> None:
    config = parse_config(json.loads(config_json))

    def kill_at(name: str, data: Mapping[str, Any]) -> None:
        if name == event:
            os.kill(os.getpid(), signal.SIGKILL)

    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, Path(marker), observers=(kill_at,))
        spec = SessionSpec("crash", tools=(tool,), preapproved=(tool,))
        await app.run_turn(Mode.DAEMON, spec, "write the marker", turn_id=turn_id)
    print("the turn finished without reaching the kill point", file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
