"""MCP servers the operator configured, exposed to sessions as policed tools."""

from geodebot.engine.mcp.client import Backoff, MCPServerPool, tool_name

__all__ = ["Backoff", "MCPServerPool", "tool_name"]
