"""The evidence ledger: one redacted JSON line per model call and tool call.

Separate from the timeline: the timeline is the session's story for operators, the ledger is
evidence for audit. It holds hashes of what was sent and received (to correlate with provider
logs or the timeline) rather than the content itself, and every string passes the redactor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from geodebot.engine.llm.types import canonical_json
from geodebot.logs.redact import Redactor

log = logging.getLogger(__name__)


def content_hash(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


class EvidenceLedger:
    """Appends go straight to the file (no buffer), one ``write`` per line, so a line that
    failed (a full disk) is dropped whole and cannot turn up half-written later."""

    def __init__(self, path: Path | None, redactor: Redactor) -> None:
        self._path = path
        self._redactor = redactor
        self._fd: int | None = None
        self._failing = False
        self._lock = threading.Lock()

    def _open(self) -> int | None:
        if self._path is None:
            return None
        if self._fd is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return self._fd

    def record(self, kind: str, **fields: Any) -> None:
        """Append one row. Evidence is written after the fact: a failed append is logged and
        never fails the model or tool call it records."""
        row = {"ts": round(time.time(), 3), "kind": kind, **fields}
        line = (json.dumps(self._redactor.redact_obj(row), ensure_ascii=False) + "\n").encode()
        with self._lock:
            try:
                fd = self._open()
                if fd is None:
                    return
                written = os.write(fd, line)
                if written != len(line):
                    raise OSError(f"short write: {written} of {len(line)} bytes")
            except OSError as exc:
                if not self._failing:
                    log.error(
                        "evidence ledger %s: cannot append (%s); rows are dropped", self._path, exc
                    )
                self._failing = True
                return
            if self._failing:
                log.warning("evidence ledger %s: appending again", self._path)
                self._failing = False

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
