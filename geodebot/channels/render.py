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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import unescape

from geodebot.channels.render_markdown import (
    HEADING_RE,
    Block,
    Bullet,
    Code,
    CodeBlock,
    Heading,
    Inline,
    Kind,
    Link,
    Para,
    Quote,
    Rule,
    Span,
    Text,
    blocks,
    heading_text,
    normalise,
    parse_inline,
    scan_lines,
)
from geodebot.channels.render_split import MIN_LIMIT, split_markdown

LIMITS = {"telegram": 4096, "discord": 2000, "slack": 4000}
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
