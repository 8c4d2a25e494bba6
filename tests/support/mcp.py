"""MCP plumbing for the tests: the fake servers' paths, the child processes a test started, a
pool's state, and ``geodebot mcp serve`` as a subprocess seen through the real SDK client."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters, stdio_client
from mcp.client.session import IncomingMessage
from mcp.types import CallToolResult, TextContent

from geodebot.engine.mcp.client import MCPServerPool
from tests.support.config import TEST_KEY, TEST_KEY_ENV

ROOT = Path(__file__).resolve().parents[2]
# Run by path rather than with -m: importing the tests.support.fakes package costs a second
# per start.
FAKE = ROOT / "tests" / "support" / "fakes" / "mcp_tools_server.py"
MISBEHAVING = ROOT / "tests" / "support" / "fakes" / "mcp_misbehaving_server.py"


def children() -> set[int]:
    """Live (not yet reaped) child processes of this test process."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def wait_for_state(pool: MCPServerPool, state: str, server: str = "fake") -> None:
    for _ in range(100):
        if (await pool.status())[server]["state"] == state:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{server} never reached {state}: {await pool.status()}")


@dataclass
class Served:
    client: Client
    results: list[CallToolResult] = field(default_factory=list)

    async def run_agent(self, **arguments: Any) -> tuple[bool, str]:
        result = await self.client.call_tool("run_agent", arguments)
        self.results.append(result)
        texts = [block.text for block in result.content if isinstance(block, TextContent)]
        assert len(texts) == 1, result
        return bool(result.is_error), texts[0]


@asynccontextmanager
async def serving(tmp_path: Path, config: Path) -> AsyncIterator[Served]:
    faults: list[Exception] = []

    async def on_message(message: IncomingMessage) -> None:
        # Anything on stdout that is not a JSON-RPC message arrives here as an exception.
        if isinstance(message, Exception):
            faults.append(message)

    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "geodebot", "mcp", "serve", "--config", str(config)],
        cwd=ROOT,
        env={TEST_KEY_ENV: TEST_KEY},
    )
    stderr = tmp_path / "server-stderr.log"
    with stderr.open("w") as errlog:
        client = Client(
            stdio_client(params, errlog=errlog),
            read_timeout_seconds=30,
            message_handler=on_message,
        )
        async with client:
            served = Served(client)
            yield served
    log = stderr.read_text()
    assert faults == []
    assert "Traceback" not in log, log
    assert TEST_KEY not in log
    for result in served.results:
        assert TEST_KEY not in result.model_dump_json()
