"""What the built-in tools are configured with: one value every tool module reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
