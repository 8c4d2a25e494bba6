"""The world of tests/e2e/test_chat_slack.py: one ``geodebot serve`` process against FakeSlack
and a FakeLLMServer, with one binding (and so one session) per scenario.

The model is :class:`SceneModel`: it answers each request from what it carries, so any scene
can be asked again after a restart and gets the same answer. A user message names its scene
(``[scene:NAME]``); the scene's first request gets its tool call, or its answer when it has no
call, and a request carrying the call's result gets the answer.

The tool is the built-in ``edit_file`` (a write: it needs approval): ``geodebot serve`` runs
with its own registry, and the tools of tests/support/tools.py are for in-process tests. Each
scene's call replaces the file's :data:`END` line by ``ran <scene>`` and END again, so every
run of the call leaves one more line (:func:`tests.support.tools.marker_lines` counts them).

tests/e2e/test_files_slack.py uses the same world with :class:`FileScene` s: their binding
has ``send_file``, pre-approved (no card), and their call sends a workspace file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geodebot.config.schema import DB_FILE
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import Call, FakeLLMServer, Item, Reply
from tests.support.fakes.slack_server import FakeSlack, Posted
from tests.support.slack_world import eventually, new_ts
from tests.support.tools import marker_lines

BOT_TOKEN_ENV = "GEODEBOT_CHAT_E2E_SLACK_BOT"
APP_TOKEN_ENV = "GEODEBOT_CHAT_E2E_SLACK_APP"
ALICE = "UALICE001"  # the approver
BOB = "UBOB00001"  # allowed to talk, not to approve
END = "@@END@@"
# The preview of a turn waiting for a press on its edit_file call.
WAITING = "(waiting for approval of edit_file)"
SCENE = re.compile(r"\[scene:([\w-]+)\]")


@dataclass(frozen=True)
class Scene:
    """One scenario's chat: its channel (bound to a session of its own) and what the model
    answers there. ``tool``: the scene's call needs approval; ``answer``: the final item."""

    name: str
    channel: str
    answer: Item
    tool: bool = True
    approval_timeout_s: float | None = None

    @property
    def file(self) -> str:
        return f"{self.name}.txt"

    def call(self) -> Call:
        arguments = {"path": self.file, "old_text": END, "new_text": f"ran {self.name}\n{END}"}
        return Call("edit_file", arguments, id=f"toolu_{self.name.replace('-', '_')}")


@dataclass(frozen=True)
class FileScene(Scene):
    """A scene whose call (if ``send`` names a workspace file) is ``send_file``, which the
    binding pre-approves: it runs without a card."""

    tool: bool = False
    send: str | None = None
    caption: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool", self.send is not None)

    def call(self) -> Call:
        arguments = {"path": self.send or "", "caption": self.caption}
        return Call("send_file", arguments, id=f"toolu_{self.name.replace('-', '_')}")


class SceneModel:
    """The fake model's responder: each request answered by the scene it belongs to."""

    def __init__(self) -> None:
        self.scenes: dict[str, Scene] = {}
        self.requests: dict[str, list[dict[str, Any]]] = defaultdict(list)

    def __call__(self, body: dict[str, Any]) -> Item | None:
        messages = body.get("messages") or []
        names = SCENE.findall(json.dumps(messages))
        scene = self.scenes.get(names[-1]) if names else None
        if scene is None:
            return None  # the queue answers (and says so, if it is empty)
        self.requests[scene.name].append(body)
        if scene.tool and not tool_results(body):
            return Reply(tool_calls=[scene.call()])
        return scene.answer


def tool_results(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool_result blocks of a request's newest message."""
    messages = body.get("messages") or []
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]


def result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


def is_final(message: Posted) -> bool:
    """Whether the message's latest text came from the outbox (a reply's part), not from a
    preview: the adapter tags each message it posts or edits with the part's key."""
    payload = (message.metadata or {}).get("event_payload") or {}
    key = str(payload.get("key", ""))
    return key.startswith("gb-") and not key.startswith("gb-preview-")


def unescape(text: str) -> str:
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


@dataclass
class ChatWorld:
    slack: FakeSlack
    llm: FakeLLMServer
    model: SceneModel
    root: Path
    scenes: tuple[Scene, ...]
    # The bindings stream by default; False writes ``stream = false`` on each.
    stream: bool = True
    daemon: DaemonProcess | None = None
    daemons: list[DaemonProcess] = field(default_factory=list)
    # Checked again once the daemon has stopped (SIGTERM drains the outbox): a late
    # duplicate cannot slip in after a test's own assertion.
    afterwards: list[Callable[[], object]] = field(default_factory=list)

    @property
    def db(self) -> Path:
        return self.root / "var" / DB_FILE

    def approval_status(self, approval_id: str) -> str:
        """The stored request's status: pending, approved, denied or expired."""
        sql = "SELECT status FROM approval_requests WHERE id = ?"
        [(status,)] = stored(self.db, sql, approval_id)
        return str(status)

    def preview_of(self, message_ts: str) -> str:
        """The preview message id the store keeps for the inbox row of a user's message."""
        rows = stored(self.db, "SELECT preview FROM inbox WHERE message_id = ?", message_ts)
        return str(rows[0][0]) if rows else ""

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    def write_config(self) -> Path:
        self.workspace.mkdir(parents=True, exist_ok=True)
        for scene in self.scenes:
            (self.workspace / scene.file).write_text(END + "\n")
        path = self.root / "config.toml"
        path.write_text(
            f"""
[daemon]
state_dir = "{self.root / "var"}"
max_concurrent_sessions = 8
shutdown_grace_s = 5
user_rate_per_min = 0
stream_edit_interval_s = 0.2

[model]
provider = "anthropic"
name = "e2e-model-1"
base_url = "{self.llm.url}"
api_key_env = "{TEST_KEY_ENV}"
max_retries = 0
request_timeout_s = 30

[tools]
workspace = "{self.workspace}"

[channels.slack]
bot_token_env = "{BOT_TOKEN_ENV}"
app_token_env = "{APP_TOKEN_ENV}"
api_base_url = "{self.slack.api_base_url}"
"""
            + "".join(self._binding(scene) for scene in self.scenes)
        )
        return path

    def _binding(self, scene: Scene) -> str:
        lines = [
            "[[bindings]]",
            'platform = "slack"',
            f'channel = "{scene.channel}"',
            f'session = "{scene.name}"',
            f'allowed_users = ["{ALICE}", "{BOB}"]',
        ]
        if not self.stream:
            lines.append("stream = false")
        if isinstance(scene, FileScene):
            lines += ['tools = ["send_file"]', 'preapproved = ["send_file"]']
        elif scene.tool:
            lines += ['tools = ["edit_file"]', f'approvers = ["{ALICE}"]']
        if scene.approval_timeout_s is not None:
            lines.append(f"approval_timeout_s = {scene.approval_timeout_s}")
        return "\n" + "\n".join(lines) + "\n"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # Set here: a module's world starts before conftest's autouse fixture sets it.
        env[TEST_KEY_ENV] = TEST_KEY
        env[BOT_TOKEN_ENV] = self.slack.bot_token
        env[APP_TOKEN_ENV] = self.slack.app_token
        env.pop("GEODEBOT_CONFIG", None)
        return env

    async def start(self) -> DaemonProcess:
        """A daemon on the world's state directory (the same one after a kill)."""
        daemon = DaemonProcess(self.root / "config.toml", self.env)
        self.daemons.append(daemon)
        self.daemon = await daemon.start()
        return daemon

    async def kill_and_restart(self) -> DaemonProcess:
        assert self.daemon is not None
        await self.daemon.kill()
        return await self.start()

    # -- talking ----------------------------------------------------------------------------
    async def ask(self, scene: Scene, text: str, user: str = ALICE) -> str:
        """Post a message in the scene's channel as ``user``; its ts once the daemon acked it."""
        ts = new_ts()
        event = FakeSlack.message_event(scene.channel, user, f"[scene:{scene.name}] {text}", ts=ts)
        envelope = await self.slack.push_event(event)
        await self.slack.wait_for_ack(envelope, timeout=15)
        return ts

    async def share(
        self, scene: Scene, text: str, files: list[dict[str, Any]], user: str = ALICE
    ) -> str:
        """Share ``files`` (objects from ``FakeSlack.add_file``) with ``text`` in the scene's
        channel as ``user``; the message's ts once the daemon acked it."""
        ts = new_ts()
        caption = f"[scene:{scene.name}] {text}"
        event = FakeSlack.file_message_event(scene.channel, user, caption, files, ts=ts)
        envelope = await self.slack.push_event(event)
        await self.slack.wait_for_ack(envelope, timeout=15)
        return ts

    def posts(self, scene: Scene, thread: str | None = None) -> list[Posted]:
        posts = self.slack.posted.get(scene.channel, [])
        return [p for p in posts if thread is None or p.thread_ts == thread]

    def cards(self, scene: Scene, thread: str | None = None) -> list[Posted]:
        return [p for p in self.posts(scene, thread) if p.blocks]

    def answers(self, scene: Scene, thread: str | None = None) -> list[Posted]:
        """The messages that are not cards: previews and answers."""
        return [p for p in self.posts(scene, thread) if not p.blocks]

    async def until(
        self, check: Callable[[], bool], what: str | Callable[[], str], limit_s: float = 30.0
    ) -> None:
        """Until ``check()`` holds; else fails saying ``what`` (worked out then, if a function)."""
        try:
            await eventually(check, "", limit_s=limit_s)
        except AssertionError:
            tail = "\n".join(self.daemon.log[-30:]) if self.daemon is not None else ""
            said = what() if callable(what) else what
            raise AssertionError(f"timed out waiting for {said}\n{tail}") from None

    async def card(self, scene: Scene, thread: str) -> Posted:
        await self.until(lambda: bool(self.cards(scene, thread)), f"the card of {scene.name}")
        [card] = self.cards(scene, thread)
        return card

    async def waiting(self, scene: Scene, thread: str) -> Posted:
        """The card of a turn that waits for a press, once the chat shows all it will until
        then: the card, and where the binding streams, the preview saying what the turn waits
        for (it becomes the answer later). Both are stored too, so that a kill now loses
        neither."""
        card = await self.card(scene, thread)
        await self.until(lambda: self._card_stored(card), "the card's place in the store")
        if self.stream:
            await self.until(lambda: self._preview_stored(scene, thread), "the stored preview")
        return card

    def _card_stored(self, card: Posted) -> bool:
        rows = stored(self.db, "SELECT card FROM approval_requests")
        return any(json.loads(card_json).get("message_id") == card.ts for (card_json,) in rows)

    def _preview_stored(self, scene: Scene, thread: str) -> bool:
        previews = [p for p in self.answers(scene, thread) if p.text == WAITING]
        return len(previews) == 1 and self.preview_of(thread) == previews[0].ts

    async def answer(self, scene: Scene, thread: str, text: str) -> Posted:
        """Until a message of the thread is the final answer ``text``: that message. (A
        preview may read the same; the answer is told by the outbox key it carries.)"""

        def shown() -> list[Posted]:
            return [p for p in self.answers(scene, thread) if p.text == text and is_final(p)]

        await self.until(
            lambda: bool(shown()),
            lambda: f"the answer {text!r}; the thread shows {self.shown(scene, thread)}",
        )
        [answer] = shown()
        return answer

    def shown(self, scene: Scene, thread: str) -> list[list[str]]:
        """Every text each message of the thread showed, for a failure's message."""
        return [p.texts for p in self.posts(scene, thread)]

    def runs(self, scene: Scene) -> list[str]:
        """The lines the scene's call left: one per run."""
        return [x for x in marker_lines(self.workspace / scene.file) if x != END]

    def assert_clean_logs(self) -> None:
        for daemon in self.daemons:
            text = daemon.text()
            assert "Traceback" not in text, text[-3000:]
            for secret in (self.slack.bot_token, self.slack.app_token, TEST_KEY):
                assert secret not in text


def stored(db: Path, sql: str, *params: object) -> list[tuple[Any, ...]]:
    """Rows of a query on the daemon's store, read as another process would (WAL readers do
    not get in the daemon's way)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return conn.execute(sql, params).fetchall()
