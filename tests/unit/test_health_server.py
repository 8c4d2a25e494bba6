"""The health server's probes in process: ``/livez`` answers while the loop runs and the store
reads, whatever ``/healthz`` says of the parts that need an operator."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from geodebot.ops.health import EngineMetrics, HealthServer, Probe
from geodebot.store.records import StoreError
from geodebot.store.sqlite import SQLiteStore
from tests.support.ports import free_port


def address() -> str:
    return f"127.0.0.1:{free_port()}"


async def _never_ok() -> tuple[bool, dict[str, Any]]:
    return False, {"count": 1}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    async with SQLiteStore(tmp_path / "db.sqlite") as s:
        yield s


async def get(server: HealthServer, path: str) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{server.port}{path}") as response,
    ):
        return response.status, await response.json()


async def test_live_while_health_reports_what_needs_an_operator(store: SQLiteStore) -> None:
    probe = Probe(store, extra={"unanswered": _never_ok})
    async with HealthServer(address(), probe, EngineMetrics()) as server:
        assert (await get(server, "/healthz"))[0] == 503
        assert await get(server, "/livez") == (200, {"status": "ok"})


async def test_not_live_when_the_store_cannot_be_read(store: SQLiteStore) -> None:
    class Broken:
        async def schema_version(self) -> int:
            raise StoreError("reading the schema version failed: disk I/O error")

    probe = Probe(store)
    async with HealthServer(address(), probe, EngineMetrics()) as server:
        probe.store = Broken()  # type: ignore[assignment]  # only what /livez reads
        code, body = await get(server, "/livez")
    assert code == 503
    assert body == {"status": "dead", "store": "reading the schema version failed: disk I/O error"}


async def test_live_needs_the_token_like_the_other_probes(store: SQLiteStore) -> None:
    server = HealthServer(address(), Probe(store), EngineMetrics(), token="s3cret")
    async with server:
        assert await get(server, "/livez") == (401, {"error": "unauthorized"})
