"""Small helpers shared by the abuse tests (test_abuse_*.py)."""

from __future__ import annotations

import re
import socket

import aiohttp


def free_port() -> int:
    """A port free on 127.0.0.1 right now, for the daemon's health and metrics endpoint."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def scrape(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of ``name`` whose labels include ``labels`` in Prometheus text (0 if none)."""
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        metric_name, _, label_text = head.partition("{")
        found = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        if metric_name == name and labels.items() <= found.items():
            return float(value)
    return 0.0
