"""A disk whose syncs fail, for a daemon started with this folder on ``PYTHONPATH``.

Once the file named by ``GEODEBOT_TEST_FAILING_SYNC`` exists, every ``os.fdatasync`` and
``os.fsync`` of a SQLite log (``*-wal``) fails with EIO, as a dying disk's does: the store's
own syncs of its log (store/sqlite_sync.py). SQLite's syncs, made in C, and the rest of the
process are untouched. (Python imports ``sitecustomize`` at start-up, before any of geodebot.)
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike


def _failing(
    real: Callable[[FileDescriptorLike], None], trigger: str
) -> Callable[[FileDescriptorLike], None]:
    def sync(fd: FileDescriptorLike) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        if os.path.exists(trigger) and os.readlink(f"/proc/self/fd/{number}").endswith("-wal"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    return sync


_TRIGGER = os.environ.get("GEODEBOT_TEST_FAILING_SYNC")
if _TRIGGER:
    # Replacing the os functions is the point: the store calls them.
    os.fdatasync = _failing(os.fdatasync, _TRIGGER)  # type: ignore[assignment]
    os.fsync = _failing(os.fsync, _TRIGGER)  # type: ignore[assignment]
