"""``geodebot serve`` on Telegram for the fault tests, with config sections a test adds."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import CONTROL, answer_controls, until_answered
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer
from tests.support.fakes.telegram_server import FakeTelegram

GROUP = -1001
ALICE = 4242
TOKEN_ENV = "FAULTS_TELEGRAM_TOKEN"


class StampedTelegram(FakeTelegram):
    """FakeTelegram that notes when each Bot API call arrived, to see pauses honoured."""

    def __init__(self) -> None:
        super().__init__()
        self.stamps: list[tuple[str, float]] = []
        # Called with the method's name once a call was served, before its answer leaves.
        self.before_answer: Callable[[str], None] | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        method = request.path.rsplit("/", 1)[-1].lower()
        self.stamps.append((method, time.monotonic()))
        response = await super()._handle(request)
        if self.before_answer is not None:
            self.before_answer(method)
        return response

    def times(self, method: str) -> list[float]:
        return [at for name, at in self.stamps if name == method.lower()]


@dataclass
class TelegramWorld:
    telegram: StampedTelegram
    llm: FakeLLMServer
    tmp_path: Path
    env: dict[str, str]
    daemons: list[DaemonProcess] = field(default_factory=list)

    def write_config(
        self, *, model: str = "max_retries = 0", binding: str = "", extra: str = ""
    ) -> Path:
        """``model`` adds [model] keys, ``binding`` keys of the one binding, ``extra`` tables."""
        path = self.tmp_path / "config.toml"
        path.write_text(
            f'[daemon]\nstate_dir = "{self.tmp_path / "var"}"\nshutdown_grace_s = 5\n'
            f'[model]\nprovider = "anthropic"\nname = "faults-model"\n'
            f'base_url = "{self.llm.url}"\napi_key_env = "{TEST_KEY_ENV}"\n'
            f"{model}\n"
            f'[tools]\nipc_tools = ["get_time"]\nworkspace = "{self.tmp_path / "ws"}"\n'
            f'[channels.telegram]\ntoken_env = "{TOKEN_ENV}"\n'
            f'api_base_url = "{self.telegram.api_base_url}"\npoll_timeout_s = 1\n'
            f"{extra}\n"
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{GROUP}"\nsession = "ops"\n'
            f'allowed_users = ["{ALICE}"]\n{binding}\n'
        )
        return path

    async def start(self, **config: str) -> DaemonProcess:
        daemon = DaemonProcess(self.write_config(**config), self.env)
        self.daemons.append(daemon)
        return await daemon.start()

    def ask(self, text: str) -> int:
        return self.telegram.push_message(GROUP, text, user_id=ALICE)

    async def replies(self, count: int, limit_s: float = 30.0) -> list[str]:
        """The first ``count`` messages as they read once final. A streamed answer's first
        message is its preview, plain text; the answer replaces it in HTML, as every reply
        is sent (Telegram's plain fallback aside), unless the preview showed exactly that
        already: Telegram then refuses the edit as "not modified", and the preview stays."""

        def answered(message_id: int) -> bool:
            if self.telegram.shown(GROUP, message_id).parse_mode == "HTML":
                return True
            return (GROUP, message_id, "HTML") in self.telegram.unmodified

        def final() -> bool:
            sent = self.telegram.sent[GROUP][:count]
            return len(sent) >= count and all(answered(m.message_id) for m in sent)

        await self.telegram.wait_until(final, limit_s)
        return self.texts()[:count]

    def texts(self) -> list[str]:
        """Every message in the chat as it reads now (a preview replaced by its answer)."""
        sent = self.telegram.sent[GROUP]
        return [self.telegram.shown(GROUP, m.message_id).text for m in sent]

    async def control(self, limit_s: float = 30.0) -> list[str]:
        """A control message (tests/support/control.py) and its answer; then every text the
        chat got."""
        answer_controls(self.llm)
        self.ask(CONTROL)
        return await until_answered(self.texts, timeout=limit_s)


async def shut_down(daemon: DaemonProcess) -> None:
    """SIGTERM: the daemon was up all along and exits cleanly, leaking no secret."""
    assert daemon.proc is not None
    assert daemon.proc.returncode is None, daemon.text()[-3000:]
    code = await daemon.stop()
    text = daemon.text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert TEST_KEY not in text
