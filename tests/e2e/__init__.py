"""End-to-end tests: each file starts a real geodebot process (``serve``, ``mcp serve``,
``desktop-agent``, a child that crashes mid-turn) or runs the real CLI as a subprocess, against
the fakes of tests/support/fakes."""
