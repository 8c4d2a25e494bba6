"""The workspace file tools: behaviour on disk and every confinement rule."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import threading
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geodebot.engine.modes import Mode
from geodebot.engine.tools import ToolCallContext, ToolError, ToolSpec
from geodebot.engine.tools.builtin import BuiltinSettings, builtin_tools
from geodebot.engine.tools.builtin import files as files_mod
from geodebot.engine.tools.builtin import paths as paths_mod

CTX = ToolCallContext(session_id="s", turn_id="t", mode=Mode.IPC)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    return tmp_path / "ws"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.txt").write_text("TOP SECRET\n")
    return out


@pytest.fixture
def tools(ws: Path) -> dict[str, ToolSpec]:
    return {spec.name: spec for spec in builtin_tools(BuiltinSettings(workspace=ws))}


class Caller:
    def __init__(self, tools: dict[str, ToolSpec]) -> None:
        self.tools = tools

    async def __call__(self, name: str, **arguments: Any) -> str:
        return await self.tools[name].handler(arguments, CTX)

    async def error(self, name: str, **arguments: Any) -> str:
        with pytest.raises(ToolError) as info:
            await self.tools[name].handler(arguments, CTX)
        return str(info.value)


@pytest.fixture
def call(tools: dict[str, ToolSpec], ws: Path) -> Caller:
    return Caller(tools)


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.rglob(".geodebot-*")]


async def test_workspace_is_created_private_on_first_use(call: Caller, ws: Path) -> None:
    assert not ws.exists()
    out = await call("list_dir")
    assert stat.S_IMODE(ws.stat().st_mode) == 0o700
    assert "0 entries" in out


async def test_write_then_read_round_trip_creates_parents(call: Caller, ws: Path) -> None:
    result = await call("write_file", path="a/b/c.txt", content="héllo\nworld\n")
    assert result.startswith("created a/b/c.txt")
    assert (ws / "a/b/c.txt").read_text(encoding="utf-8") == "héllo\nworld\n"
    assert await call("read_file", path="a/b/c.txt") == "héllo\nworld\n"
    again = await call("write_file", path="a/b/c.txt", content="x")
    assert again.startswith("overwrote")
    assert (ws / "a/b/c.txt").read_text() == "x"
    assert leftovers(ws) == []


async def test_overwrite_keeps_the_file_mode(call: Caller, ws: Path) -> None:
    await call("write_file", path="run.sh", content="echo 1\n")
    (ws / "run.sh").chmod(0o750)
    await call("write_file", path="run.sh", content="echo 2\n")
    assert stat.S_IMODE((ws / "run.sh").stat().st_mode) == 0o750


async def test_a_failed_write_leaves_the_old_file_and_no_temp(
    call: Caller, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await call("write_file", path="keep.txt", content="original")

    def broken_replace(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    message = await call.error("write_file", path="keep.txt", content="new content")
    assert "No space left" in message
    assert (ws / "keep.txt").read_text() == "original"
    assert leftovers(ws) == []


async def test_read_offset_and_limit(call: Caller, ws: Path) -> None:
    await call("write_file", path="n.txt", content="".join(f"line{i}\n" for i in range(1, 11)))
    out = await call("read_file", path="n.txt", offset=3, limit=2)
    assert out.startswith("line3\nline4\n")
    assert "more follow: offset=5" in out
    assert await call("read_file", path="n.txt", offset=9) == "line9\nline10\n"
    assert "past the end" in await call("read_file", path="n.txt", offset=50)


async def test_read_output_is_capped(call: Caller, ws: Path) -> None:
    ws.mkdir()
    (ws / "big.txt").write_text("x" * 99 + "\n" * 1 + ("y" * 99 + "\n") * 2000)
    out = await call("read_file", path="big.txt")
    body, note = out.rsplit("\n[truncated", 1)
    assert len(body.encode()) <= files_mod.MAX_OUTPUT_BYTES
    assert "continue with offset=" in note


async def test_read_refuses_binary_and_non_utf8(call: Caller, ws: Path) -> None:
    ws.mkdir()
    (ws / "blob.bin").write_bytes(b"abc\x00def")
    (ws / "latin.txt").write_bytes("café".encode("latin-1"))
    assert "binary" in await call.error("read_file", path="blob.bin")
    assert "not UTF-8" in await call.error("read_file", path="latin.txt")


async def test_read_refuses_directories_and_fifos(call: Caller, ws: Path) -> None:
    (ws / "sub").mkdir(parents=True)
    os.mkfifo(ws / "pipe")
    assert "is a directory" in await call.error("read_file", path="sub")
    assert "is a directory" in await call.error("read_file", path=".")
    # Opening a FIFO for reading would block forever without O_NONBLOCK.
    assert "not a regular file" in await call.error("read_file", path="pipe")
    assert "no such file" in await call.error("read_file", path="missing.txt")


async def test_list_dir_shows_type_and_size(call: Caller, ws: Path) -> None:
    (ws / "sub").mkdir(parents=True)
    (ws / "f.txt").write_text("12345")
    (ws / "ln").symlink_to("f.txt")
    lines = (await call("list_dir", path=".")).splitlines()
    assert lines[0] == ".: 3 entries (type, size in bytes, name)"
    assert lines[1:] == ["file\t5\tf.txt", "link\t-\tln -> f.txt", "dir\t-\tsub/"]
    assert "not a directory" in await call.error("list_dir", path="f.txt")


async def test_list_dir_caps_entries(call: Caller, ws: Path) -> None:
    ws.mkdir()
    for i in range(files_mod.MAX_LIST_ENTRIES + 7):
        (ws / f"f{i:04}").touch()
    out = await call("list_dir")
    assert out.splitlines()[-1] == "[7 more entries not shown]"
    assert len(out.splitlines()) == files_mod.MAX_LIST_ENTRIES + 2


async def test_search_substring_regex_glob(call: Caller, ws: Path) -> None:
    (ws / "src").mkdir(parents=True)
    (ws / "src/a.py").write_text("import os\nx = 1  # TODO fix\n")
    (ws / "notes.md").write_text("todo: nothing\nTODO(x)\n")
    (ws / ".git").mkdir()
    (ws / ".git/config").write_text("TODO in git\n")
    out = await call("search_files", pattern="TODO")
    assert out.splitlines() == ["notes.md:2: TODO(x)", "src/a.py:2: x = 1  # TODO fix"]
    out = await call("search_files", pattern="TODO", glob="*.py")
    assert out.splitlines() == ["src/a.py:2: x = 1  # TODO fix"]
    out = await call("search_files", pattern=r"^todo\b", regex=True, ignore_case=True)
    assert out.splitlines() == ["notes.md:1: todo: nothing", "notes.md:2: TODO(x)"]
    # A regex metacharacter is literal unless regex is set.
    assert await call("search_files", pattern="TODO(x)") == "notes.md:2: TODO(x)"
    assert "invalid regex" in await call.error("search_files", pattern="(", regex=True)
    assert await call("search_files", pattern="absent") == "no matches"


async def test_search_skips_binary_and_large_files(call: Caller, ws: Path) -> None:
    ws.mkdir()
    (ws / "bin.dat").write_bytes(b"needle\x00")
    (ws / "huge.txt").write_bytes(b"needle\n" + b"x" * files_mod.MAX_SEARCH_FILE_BYTES)
    (ws / "ok.txt").write_text("a needle here\n")
    out = await call("search_files", pattern="needle")
    assert out.splitlines()[0] == "ok.txt:1: a needle here"
    assert "skipped 2 files" in out


async def test_search_caps_matches(call: Caller, ws: Path) -> None:
    ws.mkdir()
    (ws / "many.txt").write_text("hit\n" * (files_mod.MAX_MATCHES + 50))
    (ws / "more.txt").write_text("hit\n")
    lines = (await call("search_files", pattern="hit")).splitlines()
    assert len(lines) == files_mod.MAX_MATCHES + 1
    assert lines[-1] == f"[stopped at {files_mod.MAX_MATCHES} matches]"


async def test_edit_replaces_exactly_one_occurrence(call: Caller, ws: Path) -> None:
    ws.mkdir()
    (ws / "e.txt").write_bytes(b"alpha\r\nbeta\r\ngamma\r\n")
    await call("edit_file", path="e.txt", old_text="beta", new_text="BETA")
    assert (ws / "e.txt").read_bytes() == b"alpha\r\nBETA\r\ngamma\r\n"
    assert leftovers(ws) == []


@pytest.mark.parametrize(
    ("content", "old_text", "count"),
    [("one two", "three", 0), ("x x x", "x", 3), ("aaa", "aa", 2)],
)
async def test_edit_requires_a_unique_match(
    call: Caller, ws: Path, content: str, old_text: str, count: int
) -> None:
    ws.mkdir()
    (ws / "e.txt").write_text(content)
    message = await call.error("edit_file", path="e.txt", old_text=old_text, new_text="Z")
    assert f"occurs {count} times" in message
    assert (ws / "e.txt").read_text() == content


async def test_edit_refuses_binary(call: Caller, ws: Path) -> None:
    ws.mkdir()
    (ws / "b").write_bytes(b"x\x00y")
    assert "binary" in await call.error("edit_file", path="b", old_text="x", new_text="z")
    assert (ws / "b").read_bytes() == b"x\x00y"


# --- confinement -------------------------------------------------------------------------

ALL_PATH_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("read_file", {}),
    ("list_dir", {}),
    ("search_files", {"pattern": "SECRET"}),
    ("write_file", {"content": "pwned"}),
    ("edit_file", {"old_text": "TOP", "new_text": "pwned"}),
]


@pytest.mark.parametrize(("tool", "extra"), ALL_PATH_CALLS)
async def test_absolute_paths_are_refused(
    call: Caller, outside: Path, tool: str, extra: dict[str, Any]
) -> None:
    target = outside / "secret.txt"
    message = await call.error(tool, path=str(target), **extra)
    assert "absolute paths are refused" in message
    assert target.read_text() == "TOP SECRET\n"


@pytest.mark.parametrize(("tool", "extra"), ALL_PATH_CALLS)
@pytest.mark.parametrize("path", ["../outside/secret.txt", "a/../b.txt", ".."])
async def test_dotdot_is_refused_even_when_it_stays_inside(
    call: Caller, ws: Path, outside: Path, tool: str, extra: dict[str, Any], path: str
) -> None:
    (ws / "a").mkdir(parents=True)
    (ws / "b.txt").write_text("TOP\n")
    assert "'..' is not allowed" in await call.error(tool, path=path, **extra)
    assert (ws / "b.txt").read_text() == "TOP\n"
    assert (outside / "secret.txt").read_text() == "TOP SECRET\n"


@pytest.mark.parametrize(("tool", "extra"), ALL_PATH_CALLS)
@pytest.mark.parametrize("path", ["out/secret.txt", "leak.txt", "out/new.txt", "out"])
async def test_symlinks_leading_outside_are_refused(
    call: Caller, ws: Path, outside: Path, tool: str, extra: dict[str, Any], path: str
) -> None:
    ws.mkdir()
    (ws / "out").symlink_to(outside)
    (ws / "leak.txt").symlink_to(outside / "secret.txt")
    before = sorted(p.name for p in outside.iterdir())
    assert "outside the workspace" in await call.error(tool, path=path, **extra)
    assert (outside / "secret.txt").read_text() == "TOP SECRET\n"
    assert sorted(p.name for p in outside.iterdir()) == before


async def test_search_from_the_root_never_reports_outside_content(
    call: Caller, ws: Path, outside: Path
) -> None:
    ws.mkdir()
    (ws / "out").symlink_to(outside)
    (ws / "leak.txt").symlink_to(outside / "secret.txt")
    (ws / "mine.txt").write_text("SECRET inside\n")
    out = await call("search_files", pattern="SECRET")
    assert out.splitlines()[0] == "mine.txt:1: SECRET inside"
    assert "TOP SECRET" not in out


async def test_a_dangling_symlink_to_outside_is_not_written_through(
    call: Caller, ws: Path, outside: Path
) -> None:
    ws.mkdir()
    (ws / "dangle").symlink_to(outside / "created.txt")
    (ws / "dir").symlink_to(outside / "newdir")
    assert "outside the workspace" in await call.error("write_file", path="dangle", content="x")
    assert "outside" in await call.error("write_file", path="dir/f.txt", content="x")
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


async def test_symlinks_inside_the_workspace_are_followed_for_reads(call: Caller, ws: Path) -> None:
    (ws / "real").mkdir(parents=True)
    (ws / "real/a.txt").write_text("content a\n")
    (ws / "alias").symlink_to("real")
    (ws / "a-link.txt").symlink_to("real/a.txt")
    assert await call("read_file", path="alias/a.txt") == "content a\n"
    assert await call("read_file", path="a-link.txt") == "content a\n"
    assert "a.txt" in await call("list_dir", path="alias")
    await call("write_file", path="alias/b.txt", content="via alias")
    assert (ws / "real/b.txt").read_text() == "via alias"


async def test_writes_never_go_through_a_final_symlink(call: Caller, ws: Path) -> None:
    (ws / "real").mkdir(parents=True)
    (ws / "real/a.txt").write_text("content a\n")
    (ws / "a-link.txt").symlink_to("real/a.txt")
    message = await call.error("write_file", path="a-link.txt", content="x")
    assert "is a symlink" in message
    message = await call.error("edit_file", path="a-link.txt", old_text="a", new_text="b")
    assert "symlink" in message
    assert (ws / "real/a.txt").read_text() == "content a\n"
    assert (ws / "a-link.txt").is_symlink()


# The last check before opening is the one whose answer the open relies on.
@pytest.mark.parametrize(("tool", "last_checked"), [("read_file", "d/f.txt"), ("write_file", "d")])
async def test_a_directory_swapped_for_a_symlink_after_the_check_is_refused(
    call: Caller,
    ws: Path,
    outside: Path,
    monkeypatch: pytest.MonkeyPatch,
    tool: str,
    last_checked: str,
) -> None:
    (ws / "d").mkdir(parents=True)
    (ws / "d/f.txt").write_text("inside\n")
    (outside / "f.txt").write_text("TOP SECRET\n")
    checked = paths_mod.inside

    def check_then_swap(root: Path, rel: PurePosixPath) -> Path:
        real = checked(root, rel)
        # The race an attacker would need to win: swap a checked directory for a symlink.
        if rel == PurePosixPath(last_checked):
            (ws / "d").rename(ws / "d-old")
            (ws / "d").symlink_to(outside)
        return real

    # The race cannot be timed from outside, so the check itself makes the swap happen.
    monkeypatch.setattr(files_mod, "inside", check_then_swap)
    monkeypatch.setattr(paths_mod, "inside", check_then_swap)
    message = await call.error(tool, path="d/f.txt", content="pwned")
    assert message == "d/f.txt: is a symlink (or changed while opening); refused"
    assert (outside / "f.txt").read_text() == "TOP SECRET\n"
    assert sorted(p.name for p in outside.iterdir()) == ["f.txt", "secret.txt"]


@pytest.mark.parametrize(("tool", "extra"), ALL_PATH_CALLS)
@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("a\x00b", "NUL byte"),
        ("a/" * 2100, "path is too long"),
        ("x" * 300, "longer than 255 bytes"),
        ("bad\udc80", "not valid UTF-8"),
        ("", "non-empty string"),
    ],
)
async def test_malformed_paths_get_a_clear_error(
    call: Caller, tool: str, extra: dict[str, Any], path: str, expected: str
) -> None:
    assert expected in await call.error(tool, path=path, **extra)


@pytest.mark.parametrize(
    ("tool", "arguments", "expected"),
    [
        ("read_file", {"path": 5}, "path must be of type str"),
        ("read_file", {"path": "f", "offset": True}, "offset must be of type int"),
        ("read_file", {"path": "f", "offset": 0}, "offset must be at least 1"),
        ("read_file", {"path": "f", "limit": "2"}, "limit must be of type int"),
        ("write_file", {"path": "f"}, "content is required"),
        ("edit_file", {"path": "f", "old_text": "a"}, "new_text are required"),
        ("search_files", {"pattern": ""}, "pattern must not be empty"),
        ("search_files", {"pattern": "a", "regex": "yes"}, "regex must be of type bool"),
        ("list_dir", {"path": None}, "path must be of type str"),
    ],
)
async def test_handlers_check_their_arguments(
    call: Caller, tool: str, arguments: dict[str, Any], expected: str
) -> None:
    assert expected in await call.error(tool, **arguments)


PATH_PIECES = st.sampled_from(
    ["a", "secret.txt", "out", "leak.txt", "in", "up", "..", ".", "", "~", "\\", "\x00", "é", "/"]
)


@given(pieces=st.lists(PATH_PIECES, min_size=1, max_size=6))
@settings(max_examples=300, deadline=None)
def test_no_path_escapes_the_workspace(
    tmp_path_factory: pytest.TempPathFactory, pieces: list[str]
) -> None:
    base = tmp_path_factory.mktemp("fuzz")
    ws, outside = base / "ws", base / "outside"
    (ws / "in").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text("TOP SECRET\n")
    (ws / "out").symlink_to(outside)
    (ws / "leak.txt").symlink_to(outside / "secret.txt")
    (ws / "in" / "up").symlink_to("..")
    caller = Caller({s.name: s for s in builtin_tools(BuiltinSettings(workspace=ws))})
    path = "/".join(pieces)

    async def attempt() -> None:
        for tool, extra in ALL_PATH_CALLS:
            try:
                out = await caller(tool, path=path, **extra)
            except ToolError:
                continue
            assert "TOP SECRET" not in out

    asyncio.run(attempt())
    assert [p.name for p in outside.iterdir()] == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "TOP SECRET\n"


def _swap_forever(ws: Path, stop: threading.Event) -> None:
    """Flip ``ws/l`` between a symlink to a directory and a plain file, as fast as possible:
    a path check that resolves ``l`` sees it change between its own steps."""
    while not stop.is_set():
        try:
            os.symlink("d", ws / "l.new")
            os.replace(ws / "l.new", ws / "l")
            (ws / "f.new").write_bytes(b"")
            os.replace(ws / "f.new", ws / "l")
        except OSError:
            # A write_file below made "l" a directory: put the race back in place.
            with contextlib.suppress(OSError):
                shutil.rmtree(ws / "l")


async def test_a_path_swapped_during_the_check_is_refused_never_a_crash(
    call: Caller, ws: Path
) -> None:
    """realpath reads a link it has just seen; a link swapped for a file in between made
    readlink raise out of the tool ("failed unexpectedly" plus a traceback)."""
    await call("write_file", path="d/x", content="hello\n")
    stop = threading.Event()
    swapper = threading.Thread(target=_swap_forever, args=(ws, stop), daemon=True)
    swapper.start()
    crashes: list[BaseException] = []
    refused = answered = 0
    calls = [
        ("read_file", {"path": "l/x"}),
        ("list_dir", {"path": "l"}),
        ("search_files", {"pattern": "hello", "path": "l"}),
        ("edit_file", {"path": "l/x", "old_text": "hello", "new_text": "hello"}),
        ("write_file", {"path": "l/y", "content": "y"}),
    ]
    try:
        loop = asyncio.get_running_loop()
        until = loop.time() + 4.0
        while loop.time() < until:
            for name, arguments in calls:
                try:
                    await call(name, **arguments)
                    answered += 1
                except ToolError:
                    refused += 1
                except Exception as exc:
                    crashes.append(exc)
    finally:
        stop.set()
        swapper.join(5)
    assert crashes == []
    # The race was real: both outcomes happened many times.
    assert refused > 100
    assert answered > 100
