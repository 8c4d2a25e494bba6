"""Splitting the model's markdown at a platform's length limit, every part standing on its own.

:func:`split_markdown` cuts at paragraph breaks, then line breaks, then whitespace, then
anywhere, and closes/reopens a code fence cut in two; channels/render.py converts the parts.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from geodebot.channels.render_markdown import (
    MAX_FENCE_LINE,
    Kind,
    Line,
    normalise,
    open_fence,
    scan_lines,
)

# Smallest limit split_markdown accepts: room for a reopened fence, a closing fence and content.
# Conversion grows a part at most 5x (Slack's "&" -> "&amp;"), so re-splitting a part never
# needs to go below it: 5 * 400 = 2000, the smallest platform limit.
MIN_LIMIT = 400

# --- splitting --------------------------------------------------------------------------------

# Kinds of cut, best first. _ROUGH is the last resort that keeps splitting total on absurd
# input: it may leave an empty code block, split an emoji sequence or make a piece of a line
# look like a fence.
_PARA, _LINE, _SPACE, _HARD, _ROUGH = range(5)
_GLUE = frozenset("\u200d\ufe0e\ufe0f")  # zero-width joiner, variation selectors


def split_markdown(text: str, limit: int) -> list[str]:
    """``text`` in parts of at most ``limit`` characters; ``[]`` if it is blank.

    Cuts at the last paragraph break that leaves the part at least half full, else the last
    line break, else whitespace, else anywhere. A code block cut in two is closed at the end of
    the part and reopened with its info string at the start of the next one.
    """
    if limit < MIN_LIMIT:
        raise ValueError(f"limit {limit} is below {MIN_LIMIT}")
    doc = _Doc(normalise(text))
    parts: list[str] = []
    pos = doc.next_start(0)
    while pos is not None:
        part, end = doc.take(pos, limit)
        parts.append(part)
        pos = doc.next_start(end)
    return parts


@dataclass(frozen=True, slots=True)
class _Window:
    """A part being cut: it starts at ``pos``, its first non-space is at ``content``."""

    pos: int
    content: int
    prefix: int  # length of the reopened fence line in front, if any
    limit: int


class _Doc:
    """The text with its lines classified, plus tables that price any cut in O(1)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = scan_lines(text)
        self.line_of: list[int] = []  # position -> line index; a newline belongs to its line
        for index, line in enumerate(self.lines):
            self.line_of.extend([index] * (line.end - line.start + 1))
        n = len(text)
        self.last = [-1] * (n + 1)  # cut -> index of the last non-space before it
        for e in range(1, n + 1):
            self.last[e] = self.last[e - 1] if text[e - 1].isspace() else e - 1
        self.next = [n] * (n + 1)  # position -> index of the first non-space from there on
        for i in range(n - 1, -1, -1):
            self.next[i] = self.next[i + 1] if text[i].isspace() else i

    def line_at(self, pos: int) -> Line:
        return self.lines[self.line_of[pos]]

    def next_start(self, pos: int) -> int | None:
        """Where the part after a cut at ``pos`` starts (None if only whitespace is left).

        Drops blank lines and the whitespace cut at, keeps the first line's indentation.
        """
        while (i := self.next[pos]) < len(self.text):
            newline = self.text.rfind("\n", pos, i)
            start = newline + 1 if newline >= 0 else i
            line = self.line_at(start)
            if line.kind is not Kind.CLOSE:
                return start
            pos = line.end  # the previous part ended inside this fence and closed it already
        return None

    def take(self, pos: int, limit: int) -> tuple[str, int]:
        """The part starting at ``pos``, and the cut that ends it."""
        content = self.next[pos]
        if content - pos > limit // 4:
            pos = content  # indentation this deep would leave no room for content
        first = self.line_at(pos)
        prefix = first.fence.opener + "\n" if first.kind is Kind.CODE and first.fence else ""
        window = _Window(pos, content, len(prefix), limit)
        end = len(self.text) if self._fits(window, len(self.text)) else self._cut(window)
        last = self.line_at(self.last[end])
        suffix = "\n" + last.fence.closer if last.fence and last.kind is not Kind.CLOSE else ""
        return prefix + self.text[pos : self.last[end] + 1] + suffix, end

    def _fits(self, w: _Window, end: int) -> bool:
        """Does the part [w.pos, end), trimmed and with its fences closed, fit (and hold text)?"""
        last = self.last[end]
        if last < w.content:
            return False
        line = self.line_at(last)
        suffix = 1 + len(line.fence.closer) if line.fence and line.kind is not Kind.CLOSE else 0
        return w.prefix + last + 1 - w.pos + suffix <= w.limit

    def _empty_fence(self, end: int) -> bool:
        """Would a part cut here end on a fence opener, with an empty code block?"""
        return self.line_at(self.last[end]).kind is Kind.OPEN

    def _blank(self, line: Line) -> bool:
        return line.kind is Kind.TEXT and self.next[line.start] >= line.end

    def _makes_fence(self, start: int, end: int) -> bool:
        """Would text[start:end], a piece of a line cut mid-way, read as a fence line?"""
        start = self.next[start]
        # Cheap tests first: this runs for every position of a long line.
        if start >= end or self.text[start] != "`" or self.last[end] + 1 - start > MAX_FENCE_LINE:
            return False
        return open_fence(self.text[start:end]) is not None

    def _cut(self, w: _Window) -> int:
        best = [-1] * 5  # the largest fitting cut of each kind
        hi = min(len(self.text) - 1, w.pos + w.limit - w.prefix)
        self._line_cuts(w, hi, best)
        self._inner_cuts(w, hi, best)
        for kind in (_PARA, _LINE, _SPACE):
            if best[kind] - w.pos >= w.limit // 2:
                return best[kind]
        for cut in best:
            if cut >= 0:
                return cut
        raise AssertionError(f"no cut fits in {w.limit}")  # unreachable for limit >= MIN_LIMIT

    def _line_cuts(self, w: _Window, hi: int, best: list[int]) -> None:
        lines = self.lines
        index = self.line_of[w.pos]
        while index < len(lines) and lines[index].end <= hi:
            line, e = lines[index], lines[index].end
            if e > w.content and self._fits(w, e):
                after = lines[index + 1]  # exists: this line ends before the text does
                para = (
                    line.kind is Kind.CLOSE
                    or after.kind is Kind.OPEN
                    or self._blank(line)
                    or self._blank(after)
                )
                best[_ROUGH if self._empty_fence(e) else _PARA if para else _LINE] = e
            index += 1

    def _inner_cuts(self, w: _Window, hi: int, best: list[int]) -> None:
        """Cuts inside lines, scanning down so that the first fit of each kind is the largest."""
        text = self.text
        for e in range(hi, w.content, -1):
            line = self.line_at(e)
            if text[e] == "\n" or line.atomic or e == line.start or not self._fits(w, e):
                continue
            resume = min(self.next[e], line.end)  # where the next part would pick up
            clean = not (
                self._empty_fence(e)
                or self._makes_fence(max(line.start, w.pos), self.last[e] + 1)
                or self._makes_fence(resume, line.end)
            )
            if text[e] in " \t" and clean:
                best[_SPACE] = e
                return
            # A hard cut should not split an emoji sequence or a letter from its accent.
            glued = text[e] in _GLUE or text[e - 1] in _GLUE or _combining(text[e])
            if best[_HARD] < 0 and clean and not glued:
                best[_HARD] = e
            elif best[_ROUGH] < 0:
                best[_ROUGH] = e


def _combining(ch: str) -> bool:
    return unicodedata.combining(ch) != 0
