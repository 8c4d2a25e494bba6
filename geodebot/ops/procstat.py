"""The daemon's own resource figures: what a leak would show first.

Read from ``/proc/self`` (Linux, where the daemon runs under systemd); elsewhere the figures
that need it are ``None``. Shown by ``geodebot status`` and used by ``bench/soak.py``.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

_PROC = Path("/proc/self")


def process_figures() -> dict[str, Any]:
    """RSS, open file descriptors, threads and asyncio tasks of this process, now."""
    return {
        "rss_bytes": _rss_bytes(),
        "open_fds": _count(_PROC / "fd"),
        "threads": threading.active_count(),
        "asyncio_tasks": _tasks(),
    }


def _rss_bytes() -> int | None:
    try:
        for line in (_PROC / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _count(directory: Path) -> int | None:
    try:
        return len(os.listdir(directory))
    except OSError:
        return None


def _tasks() -> int | None:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # no running loop
        return None
