"""Reading the model's markdown, for :mod:`geodebot.channels.render`.

A deliberately small subset of CommonMark + GFM: the part models use in chat answers (fenced
code, ATX headings, bullets, blockquotes, rules; inline code, emphasis, strike, links). Every
function is total: any string parses, and markup that does not pair up stays literal text, so
the renderers built on this can never emit unbalanced output.
"""

from __future__ import annotations

import re
import string
import unicodedata
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

# A fence line longer than this (without surrounding whitespace) is plain text. A split inside a
# code block repeats the opening line at the top of the next part, so it must stay small next
# to the smallest split limit.
MAX_FENCE_LINE = 40
# Indentation is any whitespace so that a fence stays a fence (or not) when a split strips the
# whitespace around a line.
_FENCE_RE = re.compile(r"(\s*)(`{3,})([^`]*)")
_CLOSE_RE = re.compile(r"\s*(`{3,})\s*")


def normalise(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


@dataclass(frozen=True, slots=True)
class Fence:
    opener: str  # the opening line as written: repeated verbatim to reopen after a split
    indent: str
    ticks: int
    info: str

    @property
    def closer(self) -> str:
        return self.indent + "`" * self.ticks


def open_fence(line: str) -> Fence | None:
    """The fence this line would open outside code, or None.

    A bare closing line has the same shape, so this also says whether a line looks like a fence.
    """
    if len(line.strip()) > MAX_FENCE_LINE:
        return None
    m = _FENCE_RE.fullmatch(line)
    return Fence(line.rstrip(), m[1], len(m[2]), m[3].strip()) if m else None


def _closes(line: str, fence: Fence) -> bool:
    m = _CLOSE_RE.fullmatch(line) if len(line.strip()) <= MAX_FENCE_LINE else None
    return m is not None and len(m[1]) >= fence.ticks


class Kind(Enum):
    TEXT = "text"
    OPEN = "open"
    CODE = "code"
    CLOSE = "close"


@dataclass(frozen=True, slots=True)
class Line:
    start: int  # offsets into the text; ``end`` excludes the newline
    end: int
    kind: Kind
    fence: Fence | None  # the enclosing fence of OPEN, CODE and CLOSE lines
    atomic: bool  # fence-shaped: cutting inside it could create or break a fence


def scan_lines(text: str) -> list[Line]:
    lines: list[Line] = []
    start = 0
    fence: Fence | None = None
    for raw in text.split("\n"):
        end = start + len(raw)
        shape = open_fence(raw)
        shaped = shape is not None
        if fence is None:
            fence = shape
            lines.append(Line(start, end, Kind.TEXT if fence is None else Kind.OPEN, fence, shaped))
        elif _closes(raw, fence):
            lines.append(Line(start, end, Kind.CLOSE, fence, True))
            fence = None
        else:
            lines.append(Line(start, end, Kind.CODE, fence, shaped))
        start = end + 1
    return lines


# --- blocks -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CodeBlock:
    info: str
    code: str


@dataclass(frozen=True, slots=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True, slots=True)
class Bullet:
    indent: str
    text: str


@dataclass(frozen=True, slots=True)
class Rule:
    pass


@dataclass(frozen=True, slots=True)
class Para:
    text: str  # one line: chat platforms keep line breaks, so paragraphs are not reflowed


Simple: TypeAlias = Heading | Bullet | Rule | Para


@dataclass(frozen=True, slots=True)
class Quote:
    items: tuple[Simple, ...]  # no code or nested quotes: Telegram cannot nest blockquotes


Block: TypeAlias = CodeBlock | Quote | Simple

HEADING_RE = re.compile(r" {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*")
_HEADING_CLOSE_RE = re.compile(r"(?:^|[ \t]+)#+$")
_RULE_RE = re.compile(r" {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*")
_BULLET_RE = re.compile(r"([ \t]*)[-*+][ \t]+(.*)")
_QUOTE_RE = re.compile(r" {0,3}>[ \t]?(.*)")


def heading_text(raw: str | None) -> str:
    return _HEADING_CLOSE_RE.sub("", raw or "")


def _simple(line: str) -> Simple:
    if m := HEADING_RE.fullmatch(line):
        return Heading(len(m[1]), heading_text(m[2]))
    if _RULE_RE.fullmatch(line):
        return Rule()
    if m := _BULLET_RE.fullmatch(line):
        return Bullet(m[1], m[2])
    return Para(line)


def blocks(md: str) -> list[Block]:
    text = normalise(md)
    lines = scan_lines(text)
    out: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        raw = text[line.start : line.end]
        if line.kind is Kind.OPEN and line.fence is not None:
            indent = len(line.fence.indent)
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i].kind is Kind.CODE:
                code = text[lines[i].start : lines[i].end]
                body.append(code[min(indent, len(code) - len(code.lstrip(" \t"))) :])
                i += 1
            out.append(CodeBlock(line.fence.info, "\n".join(body)))
            i += 1  # the closing line (or past the end of an unclosed fence)
        elif _QUOTE_RE.fullmatch(raw):
            items: list[Simple] = []
            while i < len(lines) and lines[i].kind is Kind.TEXT:
                m = _QUOTE_RE.fullmatch(text[lines[i].start : lines[i].end])
                if m is None:
                    break
                items.append(_simple(m[1]))
                i += 1
            out.append(Quote(tuple(items)))
        else:
            out.append(_simple(raw))
            i += 1
    return out


# --- inline -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class Code:
    text: str


@dataclass(frozen=True, slots=True)
class Span:
    kind: str  # "b", "i" or "s"
    children: tuple[Inline, ...]


@dataclass(frozen=True, slots=True)
class Link:
    url: str
    children: tuple[Inline, ...]
    source: str  # the markdown as written, shown instead when the URL is not allowed


Inline: TypeAlias = Text | Code | Span | Link


@dataclass(frozen=True, slots=True)
class _Delim:
    char: str
    count: int
    can_open: bool
    can_close: bool


_ASCII_PUNCT = frozenset(string.punctuation)
_LINK_TAIL_RE = re.compile(
    r"\(\s*(<[^<>\n]*>|(?:[^\s()\\]|\\.|\((?:[^\s()\\]|\\.)*\))*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"
)
_AUTOLINK_RE = re.compile(r"<((?:https?|tg)://[^\s<>]+|mailto:[^\s<>]+)>", re.IGNORECASE)
# Bare URLs are kept whole so that "_" or "*" inside them never turn into emphasis.
_BARE_URL_RE = re.compile(r"https?://[^\s<>`]*[^\s<>`*_~.,;:!?()\[\]'\"]", re.IGNORECASE)
_UNESCAPE_RE = re.compile(r"\\([!-/:-@\[-`{-~])")
_SPAN_KIND = {("*", 1): "i", ("_", 1): "i", ("*", 2): "b", ("_", 2): "b", ("~", 2): "s"}
# Deeper emphasis is noise in chat and would make rendering recursion unbounded.
_MAX_NESTING = 6


def _is_punct(ch: str) -> bool:
    return ch in _ASCII_PUNCT or unicodedata.category(ch)[0] in "PS"


def _bracket_pairs(s: str) -> dict[int, int]:
    # One pass instead of a scan per "[": unmatched brackets would otherwise cost O(n^2).
    pairs: dict[int, int] = {}
    stack: list[int] = []
    i = 0
    while i < len(s):
        if s[i] == "\\":
            i += 1
        elif s[i] == "[":
            stack.append(i)
        elif s[i] == "]" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def _closing_ticks(s: str, start: int, run: int) -> int:
    """Where the backtick run of exactly ``run`` that closes a code span starts, or -1."""
    k = start
    while (k := s.find("`" * run, k)) >= 0:
        end = k + run
        if end < len(s) and s[end] == "`":
            while end < len(s) and s[end] == "`":
                end += 1
            k = end
            continue
        return k
    return -1


def _delim(s: str, i: int, j: int) -> _Delim:
    """CommonMark's flanking rules, so "2 * 3 * 4" and snake_case stay literal."""
    prev = s[i - 1] if i else " "
    nxt = s[j] if j < len(s) else " "
    left = not nxt.isspace() and (not _is_punct(nxt) or prev.isspace() or _is_punct(prev))
    right = not prev.isspace() and (not _is_punct(prev) or nxt.isspace() or _is_punct(nxt))
    if s[i] == "_":  # "_" also must not be inside a word
        can_open = left and (not right or _is_punct(prev))
        return _Delim("_", j - i, can_open, right and (not left or _is_punct(nxt)))
    return _Delim(s[i], j - i, left, right)


def parse_inline(s: str, *, links: bool = True) -> list[Inline]:
    toks: list[Inline | _Delim] = []
    buf: list[str] = []  # literal text not yet closed into a Text token
    pairs = _bracket_pairs(s) if links else {}
    i = 0
    while i < len(s):
        tok, i = _token(s, i, pairs, links)
        if isinstance(tok, str):
            buf.append(tok)
            continue
        if buf:
            toks.append(Text("".join(buf)))
            buf.clear()
        toks.append(tok)
    if buf:
        toks.append(Text("".join(buf)))
    return _pair_delims(toks)


def _token(s: str, i: int, pairs: dict[int, int], links: bool) -> tuple[Inline | _Delim | str, int]:
    """The token at ``s[i]`` and where the next one starts; a str is literal text."""
    c = s[i]
    m: re.Match[str] | None = None
    if c == "\\" and i + 1 < len(s) and s[i + 1] in _ASCII_PUNCT:
        return s[i + 1], i + 2
    if c in "`*_~":
        return _run(s, i)
    if c == "[" and i in pairs and (m := _LINK_TAIL_RE.match(s, pairs[i] + 1)):
        url = m[1][1:-1] if m[1].startswith("<") else m[1]  # the <url> form
        url = _UNESCAPE_RE.sub(r"\1", url)
        children = tuple(parse_inline(s[i + 1 : pairs[i]], links=False)) or (Text(url),)
        return Link(url, children, s[i : m.end()]), m.end()
    if c == "<" and links and (m := _AUTOLINK_RE.match(s, i)):
        return Link(m[1], (Text(m[1]),), m[0]), m.end()
    if c in "hH" and (m := _BARE_URL_RE.match(s, i)):
        return m[0], m.end()
    return c, i + 1


def _run(s: str, i: int) -> tuple[Code | _Delim | str, int]:
    """A run of backticks (a code span, if closed) or of emphasis characters."""
    j = i
    while j < len(s) and s[j] == s[i]:
        j += 1
    if s[i] == "`":
        k = _closing_ticks(s, j, j - i)
        if k < 0 or not s[j:k].strip():
            return s[i:j], j
        code = s[j:k]
        if code.startswith(" ") and code.endswith(" "):
            code = code[1:-1]  # CommonMark: one space of padding on each side is not code
        return Code(code), k + j - i
    if (s[i] != "~" or j - i == 2) and j - i <= 3:  # "~~" only; four or more "*" are literal
        return _delim(s, i, j), j
    return s[i:j], j


def _pair_delims(toks: list[Inline | _Delim]) -> list[Inline]:
    """Pair emphasis delimiters with a stack; whatever does not pair stays literal text.

    An opener leaves a literal placeholder in ``out``; when its closer comes, everything after
    the placeholder becomes the span's children. Openers above the matched one stay as their
    literal placeholders, which is how ``**bold *it**`` becomes bold "bold *it".
    """
    out: list[Inline] = []
    stack: list[tuple[str, int, int]] = []  # (char, count, index of the placeholder in out)
    for tok in toks:
        if not isinstance(tok, _Delim):
            out.append(tok)
            continue
        left = tok.count
        while tok.can_close and left:
            # The innermost opener of the same length, else the innermost shorter one, so that
            # "**bold *it**" is bold with a literal "*". The stack is at most _MAX_NESTING deep.
            same = [k for k, (c, n, _) in enumerate(stack) if c == tok.char and n == left]
            shorter = [k for k, (c, n, _) in enumerate(stack) if c == tok.char and n < left]
            if not (same or shorter):
                break
            k = (same or shorter)[-1]
            char, count, at = stack[k]
            del stack[k:]
            children = tuple(out[at + 1 :])
            del out[at:]
            out.append(Span(_SPAN_KIND[char, count], children))
            left -= count
        if left and tok.can_open and len(stack) < _MAX_NESTING:
            # "***x***" opens strong, then em inside it.
            for count in (2, 1) if left == 3 else (left,):
                stack.append((tok.char, count, len(out)))
                out.append(Text(tok.char * count))
        elif left:
            out.append(Text(tok.char * left))
    return out
