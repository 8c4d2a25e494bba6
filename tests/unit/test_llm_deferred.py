"""``DeferredAdapter``: the provider SDK loads on a worker thread; turns wait for it."""

from __future__ import annotations

import asyncio
import logging
import sys
import textwrap
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from geodebot.engine.llm.anthropic_adapter import AnthropicAdapter
from geodebot.engine.llm.deferred import DeferredAdapter
from geodebot.engine.llm.types import LLMAdapter, LLMRequest, Message
from tests.support.fakes.llm_server import FakeLLMServer, Reply

REQUEST = LLMRequest(system="", messages=(Message.user_text("hi"),), max_tokens=64)
MODULE = "tests.slow_sdk_module_for_deferred"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def slow_module() -> Iterator[threading.Event]:
    """A module whose import blocks until the test lets it finish, and records its thread."""
    release = threading.Event()

    class Finder:
        def find_spec(self, name: str, path: object, target: object = None) -> object:
            if name != MODULE:
                return None
            import importlib.util

            return importlib.util.spec_from_loader(name, self)  # type: ignore[arg-type]  # a loader in all but name

        def create_module(self, spec: object) -> None:
            return None

        def exec_module(self, module: types.ModuleType) -> None:
            module.thread = threading.current_thread().name  # type: ignore[attr-defined]  # a marker the test reads
            if not release.wait(10):
                raise RuntimeError("the test never released the import")

    finder = Finder()
    sys.meta_path.insert(0, finder)  # type: ignore[arg-type]  # a finder in all but name
    try:
        yield release
    finally:
        release.set()
        sys.meta_path.remove(finder)  # type: ignore[arg-type]  # a finder in all but name
        sys.modules.pop(MODULE, None)


async def test_a_turn_waits_for_the_import_which_runs_off_the_loop(
    slow_module: threading.Event,
) -> None:
    async with FakeLLMServer() as llm:
        llm.default = Reply("pong")
        built: list[LLMAdapter] = []

        def build() -> LLMAdapter:
            adapter = AnthropicAdapter(model="m", api_key="k", api_key_env="K", base_url=llm.url)
            built.append(adapter)
            return adapter

        deferred = DeferredAdapter("anthropic", "m", MODULE, build)
        assert (deferred.provider, deferred.model) == ("anthropic", "m")
        warm = asyncio.create_task(deferred.warm())
        calls = [asyncio.create_task(deferred.complete(REQUEST)) for _ in range(3)]
        await asyncio.sleep(0.2)
        # The loop kept running meanwhile; nothing was sent before the SDK was there.
        assert not any(c.done() for c in calls)
        assert llm.requests == []
        slow_module.set()
        answers = await asyncio.gather(*calls)
        assert await warm is True
        assert [a.message.text for a in answers] == ["pong"] * 3
        assert len(built) == 1  # built once, shared by every caller
        assert sys.modules[MODULE].thread != threading.current_thread().name
        await deferred.aclose()


async def test_a_broken_sdk_fails_turns_not_the_start(caplog: pytest.LogCaptureFixture) -> None:
    def build() -> LLMAdapter:
        raise AssertionError("never built without its module")

    deferred = DeferredAdapter("anthropic", "m", "geodebot_no_such_sdk_module", build)
    with caplog.at_level(logging.ERROR):
        assert await deferred.warm() is False
    assert "loading the anthropic SDK failed" in caplog.text
    with pytest.raises(ModuleNotFoundError, match="geodebot_no_such_sdk_module"):
        await deferred.complete(REQUEST)
    await deferred.aclose()  # nothing was built: nothing to close


async def test_a_stop_during_the_import_does_not_wait_for_it(tmp_path: Path) -> None:
    # A replica that loses its lease just after it started stops while the SDK still loads
    # (seconds on a busy machine). The process ends without waiting for the import: here
    # one that never finishes.
    script = tmp_path / "stop_during_import.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, importlib.util, sys, threading
            from geodebot.engine.llm.deferred import DeferredAdapter

            started = threading.Event()

            class Finder:
                def find_spec(self, name, path, target=None):
                    if name == "never_done_sdk":
                        return importlib.util.spec_from_loader(name, self)
                def create_module(self, spec):
                    return None
                def exec_module(self, module):
                    started.set()
                    threading.Event().wait()

            sys.meta_path.insert(0, Finder())

            async def main():
                deferred = DeferredAdapter("anthropic", "m", "never_done_sdk", lambda: None)
                warm = asyncio.create_task(deferred.warm())
                while not started.is_set():
                    await asyncio.sleep(0.01)
                warm.cancel()
                print("stopping", flush=True)

            asyncio.run(main())
            """
        )
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(60):
            out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert out.decode().split() == ["stopping"]
    assert proc.returncode == 0
