"""The file store: files users sent and files the agent sends, kept once by content hash.

Each file lives at ``<root>/<first two hex digits>/<sha256>``, written to a temporary name
and renamed into place, so a crash never leaves half a file under a digest and two writers
of the same bytes end with one file. Nothing here knows about chats or models; the rows
that refer to a file (inbox, outbox, the history's file blocks) hold only its digest.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from geodebot.store.records import StoredFile, StoreError

__all__ = ["FileStore"]

_DIGEST = re.compile(r"[0-9a-f]{64}")


class FileStore:
    def __init__(self, root: Path) -> None:
        self._root = root

    @property
    def root(self) -> Path:
        return self._root

    def path(self, sha256: str) -> Path:
        """Where the file with this digest is (or would be); StoreError for a malformed one,
        which could otherwise name a path outside the store."""
        if not _DIGEST.fullmatch(sha256):
            raise StoreError(f"not a SHA-256 digest: {sha256[:80]!r}")
        return self._root / sha256[:2] / sha256

    def put(self, data: bytes, *, name: str, media_type: str) -> StoredFile:
        """Keep ``data`` (once, whoever sent the same bytes before) and describe it."""
        digest = hashlib.sha256(data).hexdigest()
        target = self.path(digest)
        if not target.exists():
            try:
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd, temp = tempfile.mkstemp(dir=target.parent, prefix=".part-")
                try:
                    with os.fdopen(fd, "wb") as out:
                        out.write(data)
                        out.flush()
                        os.fsync(out.fileno())
                    os.replace(temp, target)
                except BaseException:
                    Path(temp).unlink(missing_ok=True)
                    raise
            except OSError as exc:
                raise StoreError(f"storing a file of {len(data)} bytes failed: {exc}") from exc
        return StoredFile(digest, name, media_type, len(data))

    def read(self, sha256: str) -> bytes:
        """The file's bytes; StoreError if it is missing or does not match its digest."""
        try:
            data = self.path(sha256).read_bytes()
        except OSError as exc:
            raise StoreError(f"reading stored file {sha256[:12]}… failed: {exc}") from exc
        if hashlib.sha256(data).hexdigest() != sha256:
            raise StoreError(f"stored file {sha256[:12]}… does not match its digest")
        return data

    def has(self, sha256: str) -> bool:
        return self.path(sha256).is_file()
