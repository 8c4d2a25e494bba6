"""Control messages: how a test shows that nothing (more) happened.

A test that asserts an absence (a dropped message got no answer, a reply was not sent twice,
a redelivery was not answered again) sends, after whatever must cause nothing, an ordinary
message through the same path, and waits for the answer to it. A session's messages are
answered in arrival order, and a chat's replies sent in order, so once the control is answered
anything the earlier messages would (wrongly) have caused has arrived as well: what the chat
holds then is all there is, and the test asserts exactly that, control answer last. A fixed
sleep instead passes broken code on a machine slow enough.

:func:`answer_controls` makes the fake model answer the control with :data:`CONTROL_ANSWER`,
whatever else the test scripted, so the script of the test itself stays as it was.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

from tests.support.fakes.llm_server import FakeLLMServer, Item, RecordedRequest, Reply

CONTROL = "control message: are you there?"
CONTROL_ANSWER = "control answer: still here"


def answer_controls(llm: FakeLLMServer) -> None:
    """Answer a request whose newest message is the control with :data:`CONTROL_ANSWER`;
    any other request is answered as before (responder, script, default)."""
    before = llm.responder

    def respond(body: dict[str, Any]) -> Item | None:
        messages = body.get("messages") or []
        if messages and CONTROL in json.dumps(messages[-1]):
            return Reply(CONTROL_ANSWER)
        return before(body) if before is not None else None

    llm.responder = respond


def asks_control(request: RecordedRequest) -> bool:
    """Whether a model request is the control's."""
    messages = (request.json or {}).get("messages") or []
    return bool(messages) and CONTROL in json.dumps(messages[-1])


async def until_answered(
    texts: Callable[[], Sequence[str]],
    *,
    timeout: float = 30.0,
) -> list[str]:
    """Until one of ``texts()`` (what the chat received so far) is the control's answer;
    returns them all."""
    async with asyncio.timeout(timeout):
        while True:
            found = list(texts())
            if any(CONTROL_ANSWER in text for text in found):
                return found
            await asyncio.sleep(0.02)
