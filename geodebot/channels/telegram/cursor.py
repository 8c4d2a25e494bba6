"""The poller's getUpdates offset, persisted in the cursor store so a restart resumes right
after the last committed update."""

from __future__ import annotations

import json
import logging
import time

from geodebot.channels.base import CursorStore
from geodebot.store.records import StoreError

log = logging.getLogger(__name__)

CURSOR_NAME = "telegram:offset"
# Telegram picks a random next update_id after a week without updates; an offset that old may
# lie above the new ids, and passing it would confirm (drop) them unseen.
CURSOR_MAX_AGE_S = 6 * 86_400


async def load_offset(cursors: CursorStore | None) -> int | None:
    """The offset saved by the last run, unless it is unreadable or too old to trust."""
    raw = await cursors.get_cursor(CURSOR_NAME) if cursors else None
    try:
        data = json.loads(raw or "null")
        offset, saved_at = int(data["offset"]), float(data["saved_at"])
    except (ValueError, TypeError, KeyError):
        if raw:
            log.warning("telegram: ignoring unreadable poll offset %r", raw)
        return None
    if time.time() - saved_at > CURSOR_MAX_AGE_S:
        log.info("telegram: poll offset from %.0f is too old to trust; not used", saved_at)
        return None
    return offset


async def save_offset(cursors: CursorStore | None, offset: int) -> None:
    """Save the offset; a failure is logged, since it costs only redeliveries."""
    if cursors is None:
        return
    value = json.dumps({"offset": offset, "saved_at": time.time()})
    try:
        await cursors.set_cursor(CURSOR_NAME, value)
    except StoreError as exc:
        # Only costs redelivery after a restart, which the inbox deduplicates; the store
        # says what failed (a full disk, say), a traceback would add nothing.
        log.warning("telegram: cannot save the poll offset: %s", exc)
    except Exception as exc:
        log.warning("telegram: cannot save the poll offset: %s", exc, exc_info=True)
