"""Workspace file tools: read, list, search, write and edit, confined by ``paths``."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import io
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from geodebot.engine.tools.builtin.paths import (
    inside,
    locate,
    open_dir,
    open_file,
    open_regular,
    os_errors,
    parent_fd,
)
from geodebot.engine.tools.spec import (
    Effect,
    Handler,
    Safety,
    ToolCallContext,
    ToolError,
    ToolSpec,
)

if TYPE_CHECKING:
    from geodebot.engine.tools.builtin.settings import BuiltinSettings

RESOURCE_KEYS = ("fs:workspace",)
MAX_OUTPUT_BYTES = 64 * 1024
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
MAX_LIST_ENTRIES = 500
MAX_MATCHES = 200
MAX_MATCH_CHARS = 300
# Regexes are matched only against this much of a line: re has no timeout.
MAX_SCAN_CHARS = 10_000
MAX_SEARCH_FILE_BYTES = 2 * 1024 * 1024
SEARCH_BUDGET_S = 20.0
# What one compiled search pattern may take; larger ones are refused as invalid.
RE2_MAX_MEM = 8 << 20
MAX_EDIT_BYTES = 8 * 1024 * 1024
MAX_WRITE_CHARS = 4_000_000
SNIFF_BYTES = 8192
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK so opening a FIFO cannot hang the thread; it is refused right after.
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


def _sniff_text(head: bytes, shown: str) -> None:
    if b"\x00" in head:
        raise ToolError(f"{shown}: binary file; refused")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        raise ToolError(f"{shown}: not UTF-8 text; refused") from None


def _read_file(workspace: Path, raw: str, offset: int, limit: int | None) -> str:
    root, rel, shown = locate(workspace, raw)
    real = inside(root, rel)
    with os_errors(shown), open_file(root, real, shown) as handle:
        _sniff_text(handle.read(SNIFF_BYTES), shown)
        handle.seek(0)
        with io.TextIOWrapper(handle, encoding="utf-8", errors="strict") as text:
            try:
                return _take_lines(text, offset, limit)
            except UnicodeDecodeError:
                raise ToolError(f"{shown}: not UTF-8 text; refused") from None


def _take_lines(text: io.TextIOWrapper, offset: int, limit: int | None) -> str:
    line = 1
    while line < offset:
        chunk = text.readline(65536)
        if not chunk:
            return f"[offset {offset} is past the end of the file ({line - 1} lines)]"
        line += chunk.endswith("\n")
    out: list[str] = []
    used = taken = 0
    while limit is None or taken < limit:
        chunk = text.readline(MAX_OUTPUT_BYTES - used + 1)
        if not chunk:
            break
        size = len(chunk.encode())
        if used + size > MAX_OUTPUT_BYTES:
            out.append(chunk.encode()[: MAX_OUTPUT_BYTES - used].decode("utf-8", "ignore"))
            out.append(
                f"\n[truncated at {MAX_OUTPUT_BYTES} bytes inside line {line}; "
                f"continue with offset={line}]"
            )
            return "".join(out)
        out.append(chunk)
        used += size
        if chunk.endswith("\n"):
            line += 1
            taken += 1
    if not out:
        return "[empty file]"
    if limit is not None and taken >= limit and text.read(1):
        out.append(f"[showing lines {offset}-{line - 1}; more follow: offset={line}]")
    return "".join(out)


def _list_dir(workspace: Path, raw: str) -> str:
    root, rel, shown = locate(workspace, raw)
    real = inside(root, rel)
    with os_errors(shown):
        fd = open_dir(root, real.relative_to(root).parts)
        try:
            with os.scandir(fd) as entries:
                names = sorted(entry.name for entry in entries)
            lines = [_describe(fd, name) for name in names[:MAX_LIST_ENTRIES]]
        finally:
            os.close(fd)
    if len(names) > MAX_LIST_ENTRIES:
        lines.append(f"[{len(names) - MAX_LIST_ENTRIES} more entries not shown]")
    header = f"{shown}: {len(names)} entries (type, size in bytes, name)"
    return "\n".join([header, *lines])


def _describe(dir_fd: int, name: str) -> str:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return f"gone\t-\t{name}"
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError:
            target = "?"
        return f"link\t-\t{name} -> {target}"
    if stat.S_ISDIR(st.st_mode):
        return f"dir\t-\t{name}/"
    if stat.S_ISREG(st.st_mode):
        return f"file\t{st.st_size}\t{name}"
    return f"other\t-\t{name}"


def _search(
    workspace: Path, pattern: str, regex: bool, ignore_case: bool, glob: str | None, raw: str
) -> str:
    root, rel, shown = locate(workspace, raw)
    base = inside(root, rel)
    matcher = _matcher(pattern, regex, ignore_case)
    try:
        PurePosixPath("x").match(glob or "*")
    except ValueError as exc:
        raise ToolError(f"invalid glob: {exc}") from None
    if not base.is_dir():
        raise ToolError(f"{shown}: not a directory")
    deadline = time.monotonic() + SEARCH_BUDGET_S
    found: list[str] = []
    skipped = 0
    stop_note = ""
    for path in _walk(base):
        if len(found) >= MAX_MATCHES:
            stop_note = f"[stopped at {MAX_MATCHES} matches]"
            break
        if time.monotonic() > deadline:
            stop_note = f"[search stopped after {SEARCH_BUDGET_S:g} s; results are partial]"
            break
        where = path.relative_to(root).as_posix()
        if glob and not PurePosixPath(where).match(glob):
            continue
        hits = _search_one(root, path, matcher, MAX_MATCHES - len(found))
        if hits is None:
            skipped += 1
        else:
            found.extend(f"{where}:{n}: {text}" for n, text in hits)
    lines = found or ["no matches"]
    if skipped:
        lines.append(f"[skipped {skipped} files: binary, not UTF-8, over 2 MB, or unreadable]")
    if stop_note:
        lines.append(stop_note)
    return "\n".join(lines)


def _walk(base: Path) -> Iterator[Path]:
    """Every file under ``base`` in name order, directory by directory, skipping ``.git``."""
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        for name in sorted(filenames):
            yield Path(dirpath) / name


def _matcher(pattern: str, regex: bool, ignore_case: bool) -> Any:
    """The model's pattern, compiled for RE2: matching takes time linear in the line, so no
    pattern can hold the interpreter (and with it the event loop) the way a backtracking
    engine can on a catastrophic one. RE2 has no backreferences or lookaround; such a
    pattern is refused as invalid."""
    import re2  # on first use: a daemon that never searches does not carry it

    options = re2.Options()
    options.log_errors = False  # a bad pattern is the model's error, not a daemon log line
    options.max_mem = RE2_MAX_MEM
    options.case_sensitive = not ignore_case
    options.literal = not regex
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise ToolError(f"invalid regex (RE2 syntax): {reason}") from None


def _search_one(root: Path, path: Path, matcher: Any, room: int) -> list[tuple[int, str]] | None:
    try:
        real = Path(os.path.realpath(path))
    except OSError:
        return None  # changed while being resolved: skipped like an unreadable file
    if not real.is_relative_to(root):
        return None
    try:
        with open_file(root, real, "", MAX_SEARCH_FILE_BYTES) as handle:
            data = handle.read()
        if b"\x00" in data[:SNIFF_BYTES]:
            return None
        text = data.decode("utf-8")
    except (OSError, ToolError, UnicodeDecodeError):
        return None
    hits: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if matcher.search(line, 0, MAX_SCAN_CHARS):
            hits.append((number, line.strip()[:MAX_MATCH_CHARS]))
            if len(hits) >= room:
                break
    return hits


def _atomic_write(dir_fd: int, name: str, data: bytes, shown: str) -> bool:
    """Replace ``name`` in ``dir_fd`` with ``data``; True if the file is new."""
    try:
        old = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        old = None
    if old is not None:
        if stat.S_ISLNK(old.st_mode):
            raise ToolError(f"{shown}: is a symlink; refusing to write through it")
        if stat.S_ISDIR(old.st_mode):
            raise ToolError(f"{shown}: is a directory")
        if not stat.S_ISREG(old.st_mode):
            raise ToolError(f"{shown}: not a regular file")
    tmp = f".geodebot-{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), stat.S_IMODE(old.st_mode) if old else 0o644)
            os.fsync(handle.fileno())
        # rename(2) replaces a symlink planted meanwhile instead of following it.
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)
    return old is None


def _write_file(workspace: Path, raw: str, content: str) -> str:
    root, rel, shown = locate(workspace, raw)
    try:
        data = content.encode("utf-8")
    except UnicodeEncodeError:
        raise ToolError("content is not valid UTF-8 text") from None
    with os_errors(shown):
        dir_fd = parent_fd(root, rel, shown, create=True)
        try:
            created = _atomic_write(dir_fd, rel.name, data, shown)
        finally:
            os.close(dir_fd)
    return f"{'created' if created else 'overwrote'} {shown} ({len(data)} bytes)"


def _occurrences(text: str, needle: str) -> int:
    # Overlapping matches count too: "aa" occurs twice in "aaa", and either could be meant.
    count, start = 0, text.find(needle)
    while start != -1:
        count += 1
        start = text.find(needle, start + 1)
    return count


def _edit_file(workspace: Path, raw: str, old_text: str, new_text: str) -> str:
    root, rel, shown = locate(workspace, raw)
    if not old_text:
        raise ToolError("old_text must not be empty")
    with os_errors(shown):
        dir_fd = parent_fd(root, rel, shown, create=False)
        try:
            with open_regular(dir_fd, rel.name, shown, MAX_EDIT_BYTES) as handle:
                data = handle.read()
            _sniff_text(data[:SNIFF_BYTES], shown)
            try:
                text = data.decode("utf-8")
                updated = text.replace(old_text, new_text, 1).encode("utf-8")
            except UnicodeError:
                raise ToolError(f"{shown}: not UTF-8 text (or new_text is not); refused") from None
            count = _occurrences(text, old_text)
            if count != 1:
                hint = "; include more surrounding text to make it unique" if count > 1 else ""
                raise ToolError(
                    f"{shown}: old_text occurs {count} times; it must occur exactly once{hint}"
                )
            _atomic_write(dir_fd, rel.name, updated, shown)
        finally:
            os.close(dir_fd)
    return f"edited {shown}: replaced 1 occurrence ({len(data)} -> {len(updated)} bytes)"


def _arg(arguments: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = arguments.get(key, default)
    if value is None and default is None and key not in arguments:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ToolError(f"{key} must be of type {kind.__name__}")
    if isinstance(value, int) and kind is int and value < 1:
        raise ToolError(f"{key} must be at least 1")
    return value


_PATH = {"type": "string", "minLength": 1, "maxLength": MAX_PATH_BYTES}


def _spec(
    name: str,
    description: str,
    properties: dict[str, Any],
    required: list[str],
    handler: Handler,
    *,
    write: bool = False,
    timeout_s: float = 30.0,
) -> ToolSpec:
    return ToolSpec(
        name=name,
        description=description,
        input_schema={
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        },
        safety=Safety.WRITE if write else Safety.READ,
        effect=Effect.MUTATE if write else Effect.NONE,
        handler=handler,
        resource_keys=RESOURCE_KEYS,
        timeout_s=timeout_s,
    )


async def _off_loop(func: Callable[..., str], *args: Any) -> str:
    """Run a file tool's work on a thread. The tools map the errors they expect; any other
    OSError (the tree changed under a check) is still the call's refusal, never a crash."""
    try:
        return await asyncio.to_thread(func, *args)
    except OSError as exc:
        raise ToolError(
            f"the file system refused the call ({exc.strerror or type(exc).__name__})"
        ) from None


def file_tools(settings: BuiltinSettings) -> list[ToolSpec]:
    workspace = settings.workspace

    async def read_file(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        path = _arg(arguments, "path", str)
        offset = _arg(arguments, "offset", int, 1)
        limit = _arg(arguments, "limit", int)
        return await _off_loop(_read_file, workspace, path, offset, limit)

    async def list_dir(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        return await _off_loop(_list_dir, workspace, _arg(arguments, "path", str, "."))

    async def search_files(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        pattern = _arg(arguments, "pattern", str)
        if not pattern:
            raise ToolError("pattern must not be empty")
        regex = _arg(arguments, "regex", bool, False)
        ignore_case = _arg(arguments, "ignore_case", bool, False)
        glob = _arg(arguments, "glob", str)
        path = _arg(arguments, "path", str, ".")
        return await _off_loop(_search, workspace, pattern, regex, ignore_case, glob or None, path)

    async def write_file(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        content = _arg(arguments, "content", str)
        if content is None or len(content) > MAX_WRITE_CHARS:
            raise ToolError(f"content is required and at most {MAX_WRITE_CHARS} characters")
        path = _arg(arguments, "path", str)
        return await _off_loop(_write_file, workspace, path, content)

    async def edit_file(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        path = _arg(arguments, "path", str)
        old_text = _arg(arguments, "old_text", str)
        new_text = _arg(arguments, "new_text", str)
        if old_text is None or new_text is None:
            raise ToolError("old_text and new_text are required")
        return await _off_loop(_edit_file, workspace, path, old_text, new_text)

    return [
        _spec(
            "read_file",
            "Read a UTF-8 text file in the workspace (path relative to it). offset is the "
            "1-based first line, limit the number of lines; output is capped at 64 KB.",
            {
                "path": _PATH,
                "offset": {"type": "integer", "minimum": 1},
                "limit": {"type": "integer", "minimum": 1},
            },
            ["path"],
            read_file,
        ),
        _spec(
            "list_dir",
            "List a workspace directory: type, size and name of each entry.",
            {"path": {**_PATH, "default": "."}},
            [],
            list_dir,
        ),
        _spec(
            "search_files",
            "Search workspace text files for a substring (or an RE2 regex if regex is true: "
            "no backreferences or lookaround); "
            "an optional glob such as '*.py' filters files. Returns 'path:line: text'. Skips "
            ".git, binary files and files over 2 MB.",
            {
                "pattern": {"type": "string", "minLength": 1, "maxLength": 1000},
                "regex": {"type": "boolean", "default": False},
                "ignore_case": {"type": "boolean", "default": False},
                "glob": {"type": "string", "maxLength": 200},
                "path": {**_PATH, "default": "."},
            },
            ["pattern"],
            search_files,
            timeout_s=SEARCH_BUDGET_S + 10,
        ),
        _spec(
            "write_file",
            "Create or replace a text file in the workspace with content, creating parent "
            "directories. The write is atomic.",
            {"path": _PATH, "content": {"type": "string", "maxLength": MAX_WRITE_CHARS}},
            ["path", "content"],
            write_file,
            write=True,
        ),
        _spec(
            "edit_file",
            "Replace old_text with new_text in a workspace text file. old_text must occur "
            "exactly once; include surrounding lines to make it unique.",
            {
                "path": _PATH,
                "old_text": {"type": "string", "minLength": 1},
                "new_text": {"type": "string"},
            },
            ["path", "old_text", "new_text"],
            edit_file,
            write=True,
        ),
    ]
