"""Small helpers shared by the abuse tests (test_abuse_*.py)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp

from tests.support.ports import free_port

__all__ = ["daemon_and_model", "free_port", "metric", "scrape", "scrape_until"]


def daemon_and_model(
    state_dir: Path, http_port: int, llm_url: str, key_env: str, *, daemon_extra: str = ""
) -> str:
    """The config's ``[daemon]``, ``[model]`` and ``[tools]`` tables the abuse tests share."""
    return (
        f'[daemon]\nstate_dir = "{state_dir}"\nhttp = "127.0.0.1:{http_port}"\n'
        f"shutdown_grace_s = 5\n{daemon_extra}"
        f'[model]\nprovider = "anthropic"\nname = "abuse-model"\nbase_url = "{llm_url}"\n'
        f'api_key_env = "{key_env}"\nmax_retries = 0\n'
        '[tools]\nipc_tools = ["get_time"]\n'
    )


async def scrape(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()


async def scrape_until(
    port: int,
    name: str,
    at_least: float,
    *,
    timeout: float = 30.0,
    **labels: str,
) -> str:
    """Scrape until ``name`` (with ``labels``) reaches ``at_least``; that scrape's text."""
    async with asyncio.timeout(timeout):
        while True:
            text = await scrape(port)
            if metric(text, name, **labels) >= at_least:
                return text
            await asyncio.sleep(0.05)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of ``name`` whose labels include ``labels`` in Prometheus text (0 if none)."""
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        metric_name, _, label_text = head.partition("{")
        found = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        if metric_name == name and labels.items() <= found.items():
            return float(value)
    return 0.0
