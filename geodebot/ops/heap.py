"""The garbage collector and a long-running daemon's heap.

CPython's cyclic collector now and then walks every object it tracks (a full, generation-2
collection), holding the event loop for the whole walk. Nearly everything a busy daemon
tracks lives long: what start-up made (modules, the SDKs' classes, pydantic schemas), and the
decoded contexts of its active sessions (engine/context_cache.py, tens of megabytes). Walked
again at every full collection, they made each such pause cost 30 to 240 ms under
bench/long_sessions.py (measured with ``gc.callbacks``): the largest stalls of a turn.

:class:`HeapKeeper` keeps full collections to what is new:

* once the daemon is up, it collects what start-up left as garbage and moves everything still
  alive into the collector's permanent generation (``gc.freeze``), which collections skip;
* after each full collection the collector makes by itself, what survived it is frozen too,
  so the next one walks only what was made since;
* frozen objects are still freed by reference counting when they die; only a cycle that
  forms among them after they were frozen would stay. So every ``sweep_s`` (an hour), at a
  moment no turn runs, everything is unfrozen, collected once whole and frozen again: such
  cycles last an hour at most.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["HeapKeeper"]


class HeapKeeper:
    """``busy``: whether a turn runs or waits (no sweep then). ``tick_s``: how often the
    keeper looks; freezing after a full collection waits at most this long."""

    def __init__(
        self, *, busy: Callable[[], bool], sweep_s: float = 3600.0, tick_s: float = 1.0
    ) -> None:
        self._busy = busy
        self._sweep_s = sweep_s
        self._tick_s = tick_s
        self.ticks = 0
        self._collected = False
        self._last_sweep = time.monotonic()
        self.sweeps = 0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # Called by the collector, on whatever thread collected: only note it.
        if phase == "stop" and info.get("generation") == 2:
            self._collected = True

    def freeze_start_up(self) -> int:
        """Collect, then freeze what is left; the number of objects frozen."""
        started = time.monotonic()
        gc.collect()
        gc.freeze()
        frozen = gc.get_freeze_count()
        log.info(
            "start-up heap frozen: %d objects out of full collections (%.0f ms)",
            frozen,
            (time.monotonic() - started) * 1000,
        )
        return frozen

    def sweep(self) -> None:
        """Everything unfrozen, collected once whole, and frozen again."""
        started = time.monotonic()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        self._last_sweep = time.monotonic()
        self.sweeps += 1
        log.info(
            "heap swept: %d unreachable objects, %d frozen (%.0f ms)",
            found,
            gc.get_freeze_count(),
            (self._last_sweep - started) * 1000,
        )

    async def run(self) -> None:
        """Freeze after the collector's full collections, sweep now and then; until cancelled."""
        self.freeze_start_up()
        gc.callbacks.append(self._on_gc)
        try:
            while True:
                await asyncio.sleep(self._tick_s)
                self.ticks += 1
                if self._collected:
                    self._collected = False
                    gc.freeze()
                due = time.monotonic() - self._last_sweep >= self._sweep_s
                if due and not self._busy():
                    self.sweep()
        finally:
            gc.callbacks.remove(self._on_gc)
            gc.unfreeze()
