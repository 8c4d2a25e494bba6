"""One replica of several sharing a PostgreSQL store, in the test's own process: its
configuration, its app and its session leases (what app/daemon.py builds with
``[store] url``), for tests that wire the rest (router, scheduler) themselves."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from geodebot.app.build import App
from geodebot.config.schema import Config
from geodebot.replicas.leases import SessionLeases
from tests.support.app import open_app
from tests.support.config import make_config, with_sections
from tests.support.fakes.llm_server import FakeLLMServer


@asynccontextmanager
async def replica_app(
    name: str,
    url: str,
    tmp_path: Path,
    llm: FakeLLMServer,
    stack: AsyncExitStack,
    *,
    bindings: Sequence[dict[str, Any]],
    ttl_s: float,
    jobs: Sequence[dict[str, Any]] = (),
) -> AsyncIterator[tuple[Config, App, SessionLeases]]:
    """The replica ``name``'s configuration, its app (models loaded, entered on ``stack``)
    and its session leases (not entered: the caller decides whether they are renewed)."""
    config = with_sections(
        make_config(tmp_path / name, llm),
        bindings=list(bindings),
        jobs=list(jobs),
        daemon={"state_dir": str(tmp_path / name / "var"), "replica_id": name},
        store={"url": url, "lease_ttl_s": ttl_s},
    )
    app = await open_app(config, stack, tmp_path / name / "marker")
    await app.load_models()
    yield config, app, SessionLeases(app.services.store, name, ttl_s=ttl_s, linger_s=3600)
