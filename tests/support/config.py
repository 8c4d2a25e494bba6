"""The test config: a parsed :class:`Config` against the fake model server, and the key it uses.

The key lives in the environment variable ``TEST_KEY_ENV`` (the autouse fixture in
``tests/conftest.py`` sets it), so a test can check that it never leaks.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from geodebot.config.schema import Config, parse_config
from tests.support.fakes.llm_server import FakeLLMServer

TEST_KEY_ENV = "GEODEBOT_TEST_API_KEY"
TEST_KEY = "sk-test-8c1f0e2b7d9a4b3c5e6f7a8b9c0d1e2f"


def make_config(
    tmp_path: Path,
    server: FakeLLMServer,
    *,
    provider: str = "anthropic",
    model: Mapping[str, Any] | None = None,
    budgets: Mapping[str, Any] | None = None,
) -> Config:
    base_url = server.url if provider == "anthropic" else server.openai_base_url
    data: dict[str, Any] = {
        "daemon": {"state_dir": str(tmp_path / "var")},
        "model": {
            "provider": provider,
            "name": "model-under-test-1",
            "base_url": base_url,
            "api_key_env": TEST_KEY_ENV,
            "max_retries": 0,
            "max_retry_wait_s": 1,
            "request_timeout_s": 30,
            **(model or {}),
        },
        "budgets": dict(budgets or {}),
        # Only tools the test registry has; the defaults name built-ins it leaves out.
        "tools": {"ipc_tools": ["get_time"], "headless_tools": ["get_time"]},
    }
    return parse_config(data)


def with_sections(config: Config, **sections: Any) -> Config:
    """The same config with whole top-level sections replaced."""
    data = config.model_dump(mode="json", exclude={"source"})
    data.update(sections)
    return parse_config(data)
