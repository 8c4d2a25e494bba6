"""A real MCP server (the SDK's MCPServer) with tools that misbehave on request.

Run as ``python -m tests.support.fakes.mcp_tools_server`` (stdio) or with ``--http PORT``
(streamable HTTP on 127.0.0.1, endpoint ``/mcp``). Tools:

* ``echo(text)``: the text back; ``env:NAME`` answers the variable's value or ``unset``, and
  ``env:*`` the names of all variables, so tests can see exactly which environment reached
  the server.
* ``add(a, b)``: the sum.
* ``write_note(text)``: appends a line to the file named by ``$NOTES_FILE``, so tests can
  count executions.
* ``fail()``: an MCP tool error (``isError``).
* ``hang()``: never returns, but the server stays responsive.
* ``freeze()``: blocks the server's event loop, so it answers nothing any more.
* ``crash()``: the process exits at once with status 3.
* ``pid()``: the server's process id.
* ``picture()``: a text block and an image block.
"""

from __future__ import annotations

import argparse
import base64
import os
import time

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ImageContent, TextContent

server = MCPServer("geodebot-fake-tools", log_level="WARNING")

# The smallest valid PNG: one transparent pixel.
_PIXEL = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000100ffff03000006000557bfab"
        "d40000000049454e44ae426082"
    )
).decode()


@server.tool(description="Repeat the text; env:NAME reports an environment variable.")
def echo(text: str) -> str:
    if text == "env:*":
        return ",".join(sorted(os.environ))
    if text.startswith("env:"):
        return os.environ.get(text.removeprefix("env:"), "unset")
    return text


@server.tool(description="Add two integers.")
def add(a: int, b: int) -> str:
    return str(a + b)


@server.tool(description="Append a line to $NOTES_FILE.")
def write_note(text: str) -> str:
    path = os.environ.get("NOTES_FILE")
    if not path:
        raise ToolError("NOTES_FILE is not set")
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text + "\n")
    return f"noted {text!r}"


@server.tool(description="Always fails.")
def fail() -> str:
    raise ToolError("this tool always fails")


@server.tool(description="Never returns; the server stays responsive.")
async def hang() -> str:
    await anyio.sleep_forever()
    return "unreachable"


@server.tool(description="Blocks the whole server.")
async def freeze() -> str:
    # Deliberately synchronous inside a coroutine: the event loop stops, like a wedged server.
    time.sleep(3600)  # noqa: ASYNC251  # a tool that hangs on purpose
    return "unreachable"


@server.tool(description="Exits the server process.")
def crash() -> str:
    os._exit(3)


@server.tool(description="The server's process id.")
def pid() -> str:
    return str(os.getpid())


@server.tool(description="A caption and a one-pixel image.")
def picture() -> CallToolResult:
    return CallToolResult(
        content=[
            TextContent(text="a tiny picture"),
            ImageContent(data=_PIXEL, mime_type="image/png"),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="mcp_tools_server")
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP")
    args = parser.parse_args()
    if args.http is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
