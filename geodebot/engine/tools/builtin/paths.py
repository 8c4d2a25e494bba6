"""Workspace confinement: every path a file tool touches stays inside the workspace.

Paths are checked twice: lexically (relative, no ``..``) and after resolving every existing
component. The resolved path is then opened one component at a time from a descriptor of the
workspace with ``O_NOFOLLOW``, so a symlink swapped in after the check makes the open fail
instead of escaping.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from geodebot.engine.tools.spec import ToolError

MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK so opening a FIFO cannot hang the thread; it is refused right after.
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


def ensure_workspace(workspace: Path) -> Path:
    """Create the workspace (0700) if missing and return its resolved path."""
    try:
        workspace.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    else:
        # mkdir's mode is filtered by the umask; this makes it exact.
        workspace.chmod(0o700)
    if not workspace.is_dir():
        raise ToolError("the workspace is not a directory")
    return workspace.resolve()


def relative(raw: object) -> PurePosixPath:
    if not isinstance(raw, str) or not raw:
        raise ToolError("path must be a non-empty string")
    if "\x00" in raw:
        raise ToolError("path contains a NUL byte")
    try:
        size = len(raw.encode("utf-8"))
    except UnicodeEncodeError:
        raise ToolError("path is not valid UTF-8") from None
    if size > MAX_PATH_BYTES:
        raise ToolError(f"path is too long ({size} bytes; the limit is {MAX_PATH_BYTES})")
    rel = PurePosixPath(raw)
    if rel.is_absolute():
        raise ToolError(f"{raw}: absolute paths are refused; use a path relative to the workspace")
    if ".." in rel.parts:
        raise ToolError(f"{raw}: '..' is not allowed in paths")
    if any(len(part.encode()) > MAX_NAME_BYTES for part in rel.parts):
        raise ToolError(f"{raw}: a path component is longer than {MAX_NAME_BYTES} bytes")
    return rel


def locate(workspace: Path, raw: object) -> tuple[Path, PurePosixPath, str]:
    root = ensure_workspace(workspace)
    rel = relative(raw)
    return root, rel, rel.as_posix()


def inside(root: Path, rel: PurePosixPath) -> Path:
    try:
        real = Path(os.path.realpath(root / rel))
    except OSError:
        # realpath reads a link it has just seen; one swapped for a file or directory in
        # between makes readlink fail. The path changed under the check: refuse it.
        raise ToolError(f"{rel}: changed while it was being checked; refused") from None
    if not real.is_relative_to(root):
        raise ToolError(f"{rel}: resolves outside the workspace (through a symlink); refused")
    return real


@contextlib.contextmanager
def os_errors(shown: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError:
        raise ToolError(f"{shown}: no such file or directory") from None
    except NotADirectoryError:
        raise ToolError(f"{shown}: not a directory (or a parent of it is not)") from None
    except IsADirectoryError:
        raise ToolError(f"{shown}: is a directory") from None
    except PermissionError:
        raise ToolError(f"{shown}: permission denied") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ToolError(f"{shown}: is a symlink (or changed while opening); refused") from None
        raise ToolError(f"{shown}: {exc.strerror or exc}") from None


def open_dir(root: Path, parts: tuple[str, ...], *, create: bool = False) -> int:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except NotADirectoryError:
                # O_DIRECTORY reports a symlink as "not a directory"; say what it is.
                if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise OSError(errno.ELOOP, "symlink") from None
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(dir_fd: int, name: str, shown: str, max_bytes: int | None = None) -> BinaryIO:
    fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ToolError(f"{shown}: is a directory (use list_dir)")
        if not stat.S_ISREG(st.st_mode):
            raise ToolError(f"{shown}: not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise ToolError(f"{shown}: too large ({st.st_size} bytes; limit {max_bytes})")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_file(root: Path, real: Path, shown: str, max_bytes: int | None = None) -> BinaryIO:
    parts = real.relative_to(root).parts
    if not parts:
        raise ToolError(f"{shown}: is a directory (use list_dir)")
    dir_fd = open_dir(root, parts[:-1])
    try:
        return open_regular(dir_fd, parts[-1], shown, max_bytes)
    finally:
        os.close(dir_fd)


def parent_fd(root: Path, rel: PurePosixPath, shown: str, *, create: bool) -> int:
    if not rel.parts:
        raise ToolError(f"{shown}: is a directory")
    inside(root, rel)  # a final symlink leading out gets the clearer message
    parent = inside(root, rel.parent)
    return open_dir(root, parent.relative_to(root).parts, create=create)
