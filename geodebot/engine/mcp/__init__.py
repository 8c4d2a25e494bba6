"""MCP both ways at the engine's edge: the client pool (client.py, connection.py) and the trust
store for a project's own servers (trust.py). Nothing here is imported by the package itself:
the mcp SDK takes over a second to import, so only a configured server loads it."""
