"""The model's markdown as each chat platform wants it, split at the platform's length limit.

Pure functions, no I/O and no SDK: adapters call :func:`render_for` and send the parts in order.

* :func:`split_markdown` cuts at paragraph breaks, then line breaks, then whitespace, then
  anywhere, and closes/reopens a code fence cut in two, so every part stands on its own.
* :func:`to_telegram_html`, :func:`to_slack_mrkdwn` and :func:`to_discord` convert one part;
  :func:`to_telegram_plain` (or :func:`telegram_text` of a rendered part) is the fallback when
  Telegram rejects a part's entities.
* Nothing is dropped: a part that conversion pushed over the limit is split again, smaller.

:func:`render_for` measures in UTF-16 code units (how Telegram counts, never less than the
character count), so an emoji-heavy answer just gets another part.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import unescape

from geodebot.channels.render_markdown import (
    HEADING_RE,
    MAX_FENCE_LINE,
    Block,
    Bullet,
    Code,
    CodeBlock,
    Heading,
    Inline,
    Kind,
    Line,
    Link,
    Para,
    Quote,
    Rule,
    Span,
    Text,
    blocks,
    heading_text,
    normalise,
    open_fence,
    parse_inline,
    scan_lines,
)

LIMITS = {"telegram": 4096, "discord": 2000, "slack": 4000}
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


# --- blocks, the same walk for every target -------------------------------------------------

_RULE = "———"


@dataclass(frozen=True, slots=True)
class _Style:
    inline: Callable[[Sequence[Inline]], str]
    code: Callable[[str, str], str]  # (info string, code) -> code block
    quote: Callable[[list[str]], str]  # rendered lines -> quote
    bold_headings: bool = True


def _render(md: str, style: _Style) -> str:
    return "\n".join(_render_block(block, style) for block in blocks(md))


def _render_block(block: Block, style: _Style) -> str:
    match block:
        case CodeBlock(info=info, code=code):
            # Telegram rejects an empty pre entity; elsewhere an empty block is just noise.
            return style.code(info, code) if code.strip() else ""
        case Quote(items=items):
            return style.quote([_render_block(item, style) for item in items])
        case Heading(text=text):
            nodes = parse_inline(text)
            bold = style.bold_headings and nodes
            return style.inline([Span("b", tuple(nodes))] if bold else nodes)
        case Bullet(indent=indent, text=text):
            return f"{indent}• {style.inline(parse_inline(text))}"
        case Rule():
            return _RULE
        case Para(text=text):
            return style.inline(parse_inline(text))


# --- Telegram ---------------------------------------------------------------------------------

_TELEGRAM_URL = re.compile(r"(?:https?|tg)://\S+", re.IGNORECASE)
_LANG = re.compile(r"[\w#+.-]{1,32}")
_EMPTY_TAG = re.compile(r"<(b|i|s)></\1>")
_TAG = re.compile(r"<[^>]*>")


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_telegram_html(md: str) -> str:
    """Telegram Bot API HTML (parse_mode="HTML"): only b, i, s, code, pre, a, blockquote."""
    html = _render(md, _TELEGRAM)
    # Closing and reopening formatting around inline code can leave empty pairs behind.
    while (dropped := _EMPTY_TAG.sub("", html)) != html:
        html = dropped
    return html


def _telegram_pre(info: str, code: str) -> str:
    lang = info.split()[0] if info else ""
    if _LANG.fullmatch(lang):
        return f'<pre><code class="language-{lang}">{_html(code)}</code></pre>'
    return f"<pre>{_html(code)}</pre>"


def _telegram_quote(lines: list[str]) -> str:
    inner = "\n".join(lines)
    return f"<blockquote>{inner}</blockquote>" if inner.strip() else inner


def _telegram_inline(nodes: Sequence[Inline], tags: tuple[str, ...] = ()) -> str:
    """``tags`` are the formatting tags open around ``nodes``, outermost first."""
    out: list[str] = []
    for node in nodes:
        match node:
            case Text(text=text):
                out.append(_html(text))
            case Code(text=text) if "a" in tags:
                out.append(_html(text))  # a text link cannot contain a code entity
            case Code(text=text):
                # Nor can bold/italic/strike: close them around the code, reopen after.
                closing = "".join(f"</{tag}>" for tag in reversed(tags))
                opening = "".join(f"<{tag}>" for tag in tags)
                out.append(f"{closing}<code>{_html(text)}</code>{opening}")
            case Span(kind=kind, children=children) if kind in tags:
                out.append(_telegram_inline(children, tags))
            case Span(kind=kind, children=children):
                out.append(f"<{kind}>{_telegram_inline(children, (*tags, kind))}</{kind}>")
            case Link(url=url, children=children) if "a" not in tags and _TELEGRAM_URL.match(url):
                href = _html(url).replace('"', "&quot;")
                out.append(f'<a href="{href}">{_telegram_inline(children, (*tags, "a"))}</a>')
            case Link(source=source):
                out.append(_html(source))
    return "".join(out)


_TELEGRAM = _Style(_telegram_inline, _telegram_pre, _telegram_quote)


def to_telegram_plain(md: str) -> str:
    """Readable text without markup, for sending without a parse mode."""
    return _render(md, _PLAIN)


def _plain_inline(nodes: Sequence[Inline]) -> str:
    out: list[str] = []
    for node in nodes:
        match node:
            case Text(text=text) | Code(text=text):
                out.append(text)
            case Span(children=children):
                out.append(_plain_inline(children))
            case Link(url=url, children=children) if _TELEGRAM_URL.match(url):
                label = _plain_inline(children)
                out.append(label if label == url else f"{label} ({url})")
            case Link(source=source):
                out.append(source)
    return "".join(out)


_PLAIN = _Style(
    _plain_inline,
    lambda _info, code: code,
    lambda lines: "\n".join(f"> {line}" for line in lines),
    bold_headings=False,
)


def telegram_text(html: str) -> str:
    """The text Telegram shows for our HTML: what its length limit counts, and a fallback."""
    return unescape(_TAG.sub("", html))


# --- Slack ------------------------------------------------------------------------------------

_SLACK_URL = re.compile(r"(?:https?://|mailto:)\S+", re.IGNORECASE)
_SLACK_MARK = {"b": "*", "i": "_", "s": "~"}


def _slack(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_slack_mrkdwn(md: str) -> str:
    """Slack mrkdwn: *bold*, _italic_, ~strike~, <url|text>; &, < and > escaped."""
    return _render(md, _SLACK)


def _slack_inline(nodes: Sequence[Inline], kinds: tuple[str, ...] = ()) -> str:
    out: list[str] = []
    for node in nodes:
        match node:
            case Text(text=text):
                out.append(_slack(text))
            case Code(text=text):
                out.append(f"`{_slack(text)}`")
            case Span(kind=kind, children=children) if kind in kinds:
                out.append(_slack_inline(children, kinds))
            case Span(kind=kind, children=children):
                mark = _SLACK_MARK[kind]
                out.append(f"{mark}{_slack_inline(children, (*kinds, kind))}{mark}")
            case Link(url=url, children=children) if _SLACK_URL.match(url):
                # "|" and ">" would end the URL early; percent-encoding keeps the address.
                href = _slack(url.replace("|", "%7C")).replace("&lt;", "%3C").replace("&gt;", "%3E")
                out.append(f"<{href}|{_slack(_plain_inline(children))}>")
            case Link(source=source):
                out.append(_slack(source))
    return "".join(out)


def _slack_code(info: str, code: str) -> str:
    # Slack would show the info string as the first line of code, so it goes. The code is not
    # converted, but &, < and > are still escaped: Slack parses them everywhere. Slack has no
    # longer fences, so a ``` inside the code gets zero-width spaces or it would end the block.
    code = _TICKS.sub(lambda m: "\u200b".join(m[0]), code)
    return f"```\n{_slack(code)}\n```"


_TICKS = re.compile(r"`{3,}")
_SLACK = _Style(
    _slack_inline, _slack_code, lambda lines: "\n".join(f"&gt; {line}" for line in lines)
)


# --- Discord ----------------------------------------------------------------------------------

_MASS_MENTION = re.compile(r"@(everyone|here)")


def to_discord(md: str) -> str:
    """Discord reads CommonMark-ish markdown already; only mass mentions and deep headings."""
    text = normalise(md)
    out: list[str] = []
    for line in scan_lines(text):
        raw = text[line.start : line.end]
        if line.kind in (Kind.OPEN, Kind.CLOSE):
            # Escaping would lengthen a fence line, which can stop it being one; an info
            # string with a mass mention is only a language hint, so it goes instead.
            fence = line.fence
            if fence is not None and _MASS_MENTION.search(raw):
                raw = fence.indent + "`" * fence.ticks
            out.append(raw)
            continue
        m = HEADING_RE.fullmatch(raw) if line.kind is Kind.TEXT else None
        # Inner "**" would close the bold early; the whole line is bold anyway.
        title = heading_text(m[2]).replace("**", "").strip() if m else ""
        # Discord renders #, ## and ### only; deeper ones would show their hashes.
        line_out = f"**{title}**" if m and len(m[1]) > 3 and title else raw
        # Also inside code: the zero-width space costs nothing there and no ping slips through.
        out.append(_MASS_MENTION.sub("@\u200b\\1", line_out))
    return "\n".join(out)


# --- per platform -----------------------------------------------------------------------------


def render_for(platform: str, md: str) -> list[str]:
    """``md`` as messages for ``platform``: each valid on its own and within the limit."""
    if platform not in LIMITS:
        raise ValueError(f"unknown platform {platform!r}")
    limit = LIMITS[platform]
    out: list[str] = []
    for part in split_markdown(md, limit):
        out.extend(_render_part(platform, part, limit))
    return out


def _render_part(platform: str, part: str, limit: int) -> list[str]:
    rendered = _convert(platform, part)
    size = _utf16(telegram_text(rendered) if platform == "telegram" else rendered)
    if size <= limit:
        return [rendered]
    # Escaping or UTF-16 surrogates pushed it over: split again, smaller in proportion.
    smaller = max(MIN_LIMIT, min(len(part) - 1, len(part) * limit // size))
    if smaller >= len(part):
        raise AssertionError(f"{len(part)} characters render to {size}")  # see MIN_LIMIT
    return [
        piece
        for sub in split_markdown(part, smaller)
        for piece in _render_part(platform, sub, limit)
    ]


def _convert(platform: str, part: str) -> str:
    if platform == "telegram":
        html = _trim(to_telegram_html(part))
        # Markup with nothing to show (an empty heading or code block): send the source.
        return html if telegram_text(html).strip() else _html(part)
    if platform == "slack":
        mrkdwn = _trim(to_slack_mrkdwn(part))
        return mrkdwn if mrkdwn.strip() else _slack(part)
    return to_discord(part)


def _trim(text: str) -> str:
    """Without blank lines at either end (an empty code block renders as one)."""
    return re.sub(r"\A(?:[^\S\n]*\n)+", "", text).rstrip()


def _utf16(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2
