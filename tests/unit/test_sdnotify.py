"""sd_notify: READY only when every channel connected, watchdog pings from the event loop,
STOPPING on SIGTERM; a plain no-op without systemd."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from geodebot.ops.sdnotify import SystemdNotifier
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer
from tests.support.fakes.telegram_server import FakeTelegram


class NotifySocket:
    """What systemd listens on: a unix datagram socket read by a thread, so each datagram is
    stamped when it arrives even while the event loop under test is blocked."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(0.05)
        self.received: list[tuple[float, list[str]]] = []
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closing.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.received.append((time.monotonic(), data.decode().split("\n")))

    def drain(self) -> list[tuple[float, list[str]]]:
        return list(self.received)

    def fields(self) -> list[str]:
        return [field for _, fields in self.drain() for field in fields]

    async def wait_for(self, field: str, timeout: float = 20.0) -> float:
        """Monotonic time at which a datagram carrying ``field`` arrived."""
        async with asyncio.timeout(timeout):
            while True:
                for at, fields in self.drain():
                    if field in fields:
                        return at
                await asyncio.sleep(0.02)

    def close(self) -> None:
        self._closing.set()
        self._reader.join()
        self.sock.close()


@contextmanager
def notify_socket(abstract: bool = False) -> Iterator[NotifySocket]:
    # Unix socket paths are short (108 bytes): not under pytest's long tmp_path.
    with tempfile.TemporaryDirectory(prefix="gb-") as directory:
        name = f"\0geodebot-test-{os.getpid()}-{time.monotonic_ns()}" if abstract else ""
        listener = NotifySocket(name or str(Path(directory) / "notify"))
        try:
            yield listener
        finally:
            listener.close()


def env_for(listener: NotifySocket, **extra: str) -> dict[str, str]:
    address = listener.address
    shown = "@" + address[1:] if address.startswith("\0") else address
    return {"NOTIFY_SOCKET": shown, **extra}


# -- the notifier -----------------------------------------------------------------------------
def test_without_notify_socket_nothing_is_sent() -> None:
    notifier = SystemdNotifier({})
    assert not notifier.enabled
    assert notifier.notify("READY=1") is False
    assert notifier.watchdog_interval_s is None


@pytest.mark.parametrize("abstract", [False, True])
def test_fields_arrive_as_one_datagram(abstract: bool) -> None:
    with notify_socket(abstract) as listener:
        notifier = SystemdNotifier(env_for(listener))
        notifier.ready("serving: line\nbreak")
        notifier.stopping()
        notifier.close()
        time.sleep(0.2)
        [(_, first), (_, second)] = listener.drain()
    assert first == ["READY=1", "STATUS=serving: line break"]
    assert second == ["STOPPING=1", "STATUS=stopping"]


def test_an_unreachable_socket_is_reported_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": "/nonexistent/geodebot/notify"})
    assert notifier.notify("READY=1") is False
    assert notifier.notify("READY=1") is False
    assert len([r for r in caplog.records if "cannot reach" in r.getMessage()]) == 1


def test_watchdog_interval_is_half_and_only_for_the_watched_process() -> None:
    env = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "30000000"}
    assert SystemdNotifier(env).watchdog_interval_s == 15.0
    mine = SystemdNotifier({**env, "WATCHDOG_PID": str(os.getpid())})
    assert mine.watchdog_interval_s == 15.0
    assert SystemdNotifier({**env, "WATCHDOG_PID": "1"}).watchdog_interval_s is None
    assert SystemdNotifier({**env, "WATCHDOG_USEC": "0"}).watchdog_interval_s is None


async def test_a_blocked_event_loop_stops_the_pings() -> None:
    with notify_socket() as listener:
        notifier = SystemdNotifier(env_for(listener, WATCHDOG_USEC="100000"))
        pinger = asyncio.create_task(notifier.run_watchdog(lambda: "fine"))
        await asyncio.sleep(0.3)
        time.sleep(0.6)  # noqa: ASYNC251 - the point: a loop wedged by blocking code
        await asyncio.sleep(0.3)
        pinger.cancel()
        await asyncio.gather(pinger, return_exceptions=True)
        notifier.close()
        pings = [at for at, fields in listener.drain() if "WATCHDOG=1" in fields]
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert len(pings) >= 5
    assert max(gaps) >= 0.55  # systemd would have seen silence past WATCHDOG_USEC
    assert sorted(gaps)[len(gaps) // 2] < 0.1  # otherwise every 50 ms
    assert listener.received[0][1] == ["WATCHDOG=1", "STATUS=fine"]


# -- geodebot serve under a notify socket -----------------------------------------------------
@pytest.fixture
async def telegram() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram() as fake:
        yield fake


def daemon_config(tmp_path: Path, llm: FakeLLMServer, telegram: FakeTelegram) -> Path:
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "var"}"\n'
        f'[model]\nprovider = "anthropic"\nname = "m"\nbase_url = "{llm.url}"\n'
        f'api_key_env = "{TEST_KEY_ENV}"\n'
        '[tools]\nipc_tools = ["get_time"]\n'
        f'[channels.telegram]\ntoken_env = "SDN_TELEGRAM_TOKEN"\n'
        f'api_base_url = "{telegram.api_base_url}"\npoll_timeout_s = 1\n'
        '[[bindings]]\nplatform = "telegram"\nchannel = "-1001"\nsession = "ops"\n'
        'allowed_users = ["*"]\n'
    )
    return config


async def test_serve_is_ready_after_its_channel_connected_pings_and_says_stopping(
    tmp_path: Path, llm_server: FakeLLMServer, telegram: FakeTelegram
) -> None:
    # The first connection attempt fails: READY=1 has to wait for the retry.
    telegram.fail_next("getMe", 502, "Bad Gateway")
    with notify_socket() as listener:
        env = dict(
            os.environ,
            SDN_TELEGRAM_TOKEN=telegram.token,
            **{TEST_KEY_ENV: TEST_KEY},
            **env_for(listener, WATCHDOG_USEC="400000"),
        )
        daemon = DaemonProcess(daemon_config(tmp_path, llm_server, telegram), env)
        await daemon.start()
        try:
            await listener.wait_for("READY=1")
            assert telegram.count("getMe") >= 2
            assert telegram.count("getUpdates") >= 1
            first_ping = await listener.wait_for("WATCHDOG=1")
            await asyncio.sleep(1.0)
            pings = [at for at, f in listener.drain() if "WATCHDOG=1" in f and at >= first_ping]
            assert len(pings) >= 4  # every 0.2 s
        finally:
            assert await daemon.stop() == 0
        await listener.wait_for("STOPPING=1", timeout=5)
    fields = listener.fields()
    ready = next(i for i, f in enumerate(fields) if f == "READY=1")
    assert fields[ready + 1] == "STATUS=serving: 1/1 channels connected, 0 turns running, 0 queued"
    assert fields.index("STOPPING=1") > ready
    assert "Traceback" not in daemon.text()
