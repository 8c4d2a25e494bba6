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

After the start-up freeze and after each sweep, the C allocator is asked to give back to the
system the free memory those collections and start-up's temporaries left in its heaps
(glibc's ``malloc_trim``; nothing elsewhere). Most of it is in the arena of the worker thread
that imported the model SDK (``App.load_models``): imported there, the anthropic SDK leaves
0.85 MiB more RSS than imported on the main thread, of which the trim gives back 0.5 MiB.
Fresh ``geodebot serve`` daemons idle after the model load (bench/telegram_bench.py's idle
rows, median of alternating runs): Telegram, Slack and Discord 133.1 -> 132.7 MB, Telegram
alone 115.7 -> 115.4 MB (that one imports ctypes for the trim, 0.3 MiB, and still gains).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["HeapKeeper", "trim_malloc"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``; None where the C library has none (musl, macOS). ctypes is
    imported only here, at the first trim: a daemon without Discord has no other use for it."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_malloc() -> bool:
    """Give the C allocator's free memory back to the system; whether any was given back."""
    trim = _malloc_trim()
    return trim is not None and trim(0) == 1


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
        trimmed = trim_malloc()
        log.info(
            "start-up heap frozen: %d objects out of full collections%s (%.0f ms)",
            frozen,
            ", free memory returned to the system" if trimmed else "",
            (time.monotonic() - started) * 1000,
        )
        return frozen

    def sweep(self) -> None:
        """Everything unfrozen, collected once whole, and frozen again."""
        started = time.monotonic()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        trim_malloc()
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
