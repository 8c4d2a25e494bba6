"""The ``geodebot`` command as a user runs it: a subprocess, with a config written for it."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.support.config import TEST_KEY_ENV
from tests.support.fakes.llm_server import FakeLLMServer

ROOT = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f'[daemon]\nstate_dir = "{tmp_path / "var"}"\n{body}')
    return path


def model_table(server: FakeLLMServer, provider: str) -> str:
    base_url = server.url if provider == "anthropic" else server.openai_base_url
    return (
        f'[model]\nprovider = "{provider}"\nname = "cli-model-7"\n'
        f'base_url = "{base_url}"\napi_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
    )


async def geodebot(
    *args: str, env: dict[str, str] | None = None, stdin: bytes | None = None
) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "geodebot",
        *args,
        cwd=ROOT,
        env=env if env is not None else dict(os.environ),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
