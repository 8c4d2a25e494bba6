"""Which turns ended in a model refusal: a completed turn whose answer is a refusal is a
failed job run, not "ok".

A lifecycle observer (it records, it never decides); the job runner asks it about its turn.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

# Refusals of turns nobody asks about (chat turns) are forgotten past this many.
MAX_REMEMBERED = 1024


class RefusalWatch:
    def __init__(self) -> None:
        self._turns: OrderedDict[str, None] = OrderedDict()

    def __call__(self, event: str, data: Mapping[str, Any]) -> None:
        if event != "llm_call":
            return
        turn = str(data.get("turn"))
        # Only the turn's last model answer counts: a refusal followed by an answer is fine.
        if data.get("stop_reason") == "refusal":
            self._turns[turn] = None
            self._turns.move_to_end(turn)
            while len(self._turns) > MAX_REMEMBERED:
                self._turns.popitem(last=False)
        else:
            self._turns.pop(turn, None)

    def refused(self, turn_id: str) -> bool:
        """Whether the turn's last model answer was a refusal (asked once per turn)."""
        if turn_id in self._turns:
            del self._turns[turn_id]
            return True
        return False
