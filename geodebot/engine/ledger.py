"""The evidence ledger: one redacted JSON line per model call and tool call.

Separate from the timeline: the timeline is the session's story for operators, the ledger is
evidence for audit. It holds hashes of what was sent and received (to correlate with provider
logs or the timeline) rather than the content itself, and every string passes the redactor.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from geodebot.engine.llm.types import canonical_json
from geodebot.redact import Redactor


def content_hash(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


class EvidenceLedger:
    def __init__(self, path: Path | None, redactor: Redactor) -> None:
        self._path = path
        self._redactor = redactor
        self._file: TextIO | None = None
        self._lock = threading.Lock()

    def _open(self) -> TextIO | None:
        if self._path is None:
            return None
        if self._file is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._file = os.fdopen(fd, "a", encoding="utf-8")
        return self._file

    def record(self, kind: str, **fields: Any) -> None:
        row = {"ts": round(time.time(), 3), "kind": kind, **fields}
        line = json.dumps(self._redactor.redact_obj(row), ensure_ascii=False)
        with self._lock:
            handle = self._open()
            if handle is None:
                return
            handle.write(line + "\n")
            handle.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
