"""Markdown -> Telegram HTML / Slack mrkdwn / Discord, and splitting at platform limits."""

from __future__ import annotations

import re
import string
from html.parser import HTMLParser

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geodebot.channels.render import (
    LIMITS,
    MIN_LIMIT,
    render_for,
    split_markdown,
    telegram_text,
    to_discord,
    to_slack_mrkdwn,
    to_telegram_html,
    to_telegram_plain,
)
from geodebot.channels.render_markdown import MAX_FENCE_LINE, Kind, scan_lines

PLATFORMS = sorted(LIMITS)
TELEGRAM_TAGS = {"b", "i", "u", "s", "code", "pre", "a", "blockquote", "tg-spoiler"}
FENCE_LINE = re.compile(r"\s*`{3,}[^`]*")
ZWSP = "\u200b"


# --- helpers ----------------------------------------------------------------------------------


class TelegramChecker(HTMLParser):
    """Collects violations of what Telegram's HTML parse mode accepts."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in TELEGRAM_TAGS:
            self.errors.append(f"tag <{tag}> not allowed")
        self._check_attributes(tag, attrs)
        self._check_nesting(tag)
        self.stack.append(tag)

    def _check_attributes(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            if len(attrs) != 1 or attrs[0][0] != "href":
                self.errors.append(f"<a> attributes {attrs}")
            elif not re.match(r"(https?|tg)://", attrs[0][1] or ""):
                self.errors.append(f"href {attrs[0][1]!r}")
        elif tag == "code" and attrs:
            if self.stack[-1:] != ["pre"] or not re.fullmatch(r"language-\S+", attrs[0][1] or ""):
                self.errors.append(f"<code {attrs}> outside <pre>")
        elif attrs:
            self.errors.append(f"<{tag}> with attributes {attrs}")

    def _check_nesting(self, tag: str) -> None:
        # Telegram: code and pre hold no other entity and are part of none (bar blockquote);
        # a text link cannot hold another link.
        inside = set(self.stack)
        if tag in ("code", "pre") and inside - {"blockquote", "pre"}:
            self.errors.append(f"<{tag}> inside {self.stack}")
        if (inside & {"code", "pre"} and tag != "code") or (tag == "a" and "a" in inside):
            self.errors.append(f"<{tag}> inside {self.stack}")
        if tag == "blockquote" and "blockquote" in self.stack:
            self.errors.append("nested blockquote")

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(f"unbalanced </{tag}>")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.errors.append(f"self-closing <{tag}/>")


def telegram_errors(html: str) -> list[str]:
    checker = TelegramChecker()
    checker.feed(html)
    checker.close()
    errors = list(checker.errors)
    if checker.stack:
        errors.append(f"unclosed {checker.stack}")
    outside_tags = re.sub(r"</?[a-z-]+(?: [^<>]*)?>", "", html)
    if re.search(r"[<>]|&(?!(?:amp|lt|gt|quot);)", outside_tags):
        errors.append("unescaped <, > or & in text")
    return errors


def measure(platform: str, part: str) -> int:
    text = telegram_text(part) if platform == "telegram" else part
    return len(text.encode("utf-16-le")) // 2


def fence_lines(part: str) -> int:
    return sum(1 for line in part.split("\n") if line.startswith("```"))


def content(text: str) -> str:
    """Non-space characters in order, fence lines left out (splitting adds and drops some)."""
    kept = [
        line
        for line in text.split("\n")
        if not (FENCE_LINE.fullmatch(line) and len(line.strip()) <= MAX_FENCE_LINE)
    ]
    return "".join("".join(kept).split())


def squash(text: str) -> str:
    return "".join(text.split())


# --- a long answer on every platform ----------------------------------------------------------

PARAGRAPHS = [f"Paragraph para-{i:03d}: " + "lorem ipsum dolor sit amet " * 9 for i in range(12)]
CODE_LINES = [f"print('code line {i:04d}')  # x < y" for i in range(150)]
LONG_LINE = "".join(string.digits[i % 10] for i in range(5000))
ANSWER = "\n\n".join(
    [*PARAGRAPHS, "```python\n" + "\n".join(CODE_LINES) + "\n```", LONG_LINE, "The end-marker."]
)


def test_long_answer_is_over_ten_thousand_characters() -> None:
    assert len(ANSWER) > 10_000


@pytest.mark.parametrize("platform", PLATFORMS)
def test_long_answer_parts_fit_keep_order_and_balance(platform: str) -> None:
    parts = render_for(platform, ANSWER)

    assert len(parts) > 1
    assert all(measure(platform, part) <= LIMITS[platform] for part in parts)
    for part in parts:
        if platform == "telegram":
            assert telegram_errors(part) == []
        else:
            assert fence_lines(part) % 2 == 0, part
        assert part == part.strip("\n")
    shown = "\n".join(telegram_text(p) if platform == "telegram" else p for p in parts)
    markers = re.findall(r"para-\d{3}|code line \d{4}|end-marker", shown)
    expected = [f"para-{i:03d}" for i in range(12)] + [f"code line {i:04d}" for i in range(150)]
    assert markers == [*expected, "end-marker"]
    assert LONG_LINE in squash(shown)
    assert squash(shown).count("lorem") == 12 * 9


def test_split_reopens_a_cut_fence_with_its_info_string() -> None:
    parts = split_markdown(ANSWER, 2000)

    cut = [p for p in parts if "code line" in p]
    assert len(cut) > 1
    assert all(p.startswith("```python\n") or p.startswith("Paragraph") for p in cut)
    assert all(p.endswith("\n```") for p in cut)
    assert all(fence_lines(p) % 2 == 0 for p in parts)
    assert content("\n".join(parts)) == content(ANSWER)


# --- splitting --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "   ", "\n\n \t\n"])
def test_blank_input_gives_no_parts(text: str) -> None:
    assert split_markdown(text, 1000) == []
    assert render_for("slack", text) == []


def test_short_input_is_one_part_trimmed() -> None:
    assert split_markdown("\n\n  hello\n\nworld  \n\n", 1000) == ["  hello\n\nworld"]


def test_limit_below_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="below"):
        split_markdown("x", MIN_LIMIT - 1)


def test_prefers_paragraph_then_line_then_space_then_hard() -> None:
    para = "a" * 300 + "\n" + "b" * 100 + "\n\n" + "c" * 300
    assert split_markdown(para, 500) == ["a" * 300 + "\n" + "b" * 100, "c" * 300]

    lines = "a" * 300 + " x\n" + "b" * 300
    assert split_markdown(lines, 500) == ["a" * 300 + " x", "b" * 300]

    words = ("word " * 200).strip()
    parts = split_markdown(words, 500)
    assert all(p.startswith("word") and p.endswith("word") for p in parts)
    assert " ".join(parts) == words

    solid = "z" * 1200
    assert split_markdown(solid, 500) == ["z" * 500, "z" * 500, "z" * 200]


def test_small_paragraph_is_not_left_alone_when_a_later_cut_fills_the_part() -> None:
    text = "Intro.\n\n" + "line of text\n" * 100
    parts = split_markdown(text, 500)
    assert parts[0].startswith("Intro.\n\nline of text")
    assert len(parts[0]) > 250


def test_unclosed_fence_is_closed_in_every_part() -> None:
    text = "```sh\n" + "\n".join(f"echo {i}" for i in range(200))
    parts = split_markdown(text, 400)
    assert len(parts) > 1
    assert all(p.startswith("```sh\n") and p.endswith("\n```") for p in parts)


def test_fence_with_four_backticks_keeps_inner_triple_backticks() -> None:
    inner = "\n".join(["```", "not a fence end", "```"] * 40)
    parts = split_markdown("````md\n" + inner + "\n````", 400)
    assert all(p.startswith("````md\n") and p.endswith("\n````") for p in parts)
    assert content("\n".join(parts)) == content(inner)


def test_mid_line_cut_never_creates_a_fence_line() -> None:
    text = "x" * 380 + " ```py " + "y" * 100
    for part in split_markdown(text, 400):
        assert not any(FENCE_LINE.fullmatch(line) for line in part.split("\n"))


def test_hard_cut_keeps_emoji_sequences_whole() -> None:
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467"
    parts = split_markdown(family * 300, 400)
    assert "".join(parts) == family * 300
    assert all(not p.startswith("\u200d") and not p.endswith("\u200d") for p in parts)


# --- conversions ------------------------------------------------------------------------------

TELEGRAM_CASES = [
    ("a < b & c > d", "a &lt; b &amp; c &gt; d"),
    ("**b** __b2__ *i* _i2_ ~~s~~", "<b>b</b> <b>b2</b> <i>i</i> <i>i2</i> <s>s</s>"),
    ("**bold *it**", "<b>bold *it</b>"),
    ("*it **bold* x**", "<i>it **bold</i> x**"),
    ("**unclosed and _also", "**unclosed and _also"),
    ("***both***", "<b><i>both</i></b>"),
    ("snake_case_name and 2 * 3 * 4", "snake_case_name and 2 * 3 * 4"),
    (r"\*not italic\*", "*not italic*"),
    ("`**x** <y> & z`", "<code>**x** &lt;y&gt; &amp; z</code>"),
    ("**run `cmd` now**", "<b>run </b><code>cmd</code><b> now</b>"),
    ("[docs](https://x.io/a_b?q=1&r=2)", '<a href="https://x.io/a_b?q=1&amp;r=2">docs</a>'),
    ('[q](https://x.io/?q="1")', '<a href="https://x.io/?q=&quot;1&quot;">q</a>'),
    ("[wiki](https://w.org/A_(b))", '<a href="https://w.org/A_(b)">wiki</a>'),
    ("[me](tg://user?id=42)", '<a href="tg://user?id=42">me</a>'),
    ("[x](javascript:alert(1))", "[x](javascript:alert(1))"),
    ("[x](data:text/html,<b>)", "[x](data:text/html,&lt;b&gt;)"),
    ("[`code` in link](https://x.io)", '<a href="https://x.io">code in link</a>'),
    ("**[bold link](https://x.io)**", '<b><a href="https://x.io">bold link</a></b>'),
    ("see https://x.io/a_b_c/*d*", "see https://x.io/a_b_c/*d*"),
    ("<https://x.io>", '<a href="https://x.io">https://x.io</a>'),
    ("# Title **x**", "<b>Title x</b>"),
    ("###### Six ##", "<b>Six</b>"),
    ("#hashtag", "#hashtag"),
    ("- one\n* two\n  + three", "• one\n• two\n  • three"),
    ("> quoted **x**\n> - item", "<blockquote>quoted <b>x</b>\n• item</blockquote>"),
    ("---", "———"),
    (
        "```py\nx = 1 < 2 and **y**\n```",
        '<pre><code class="language-py">x = 1 &lt; 2 and **y**</code></pre>',
    ),
    ("```{.weird}\n<x>\n```", "<pre>&lt;x&gt;</pre>"),
    ("  ```\n  indented\n    more\n  ```", "<pre>indented\n  more</pre>"),
    ("```\n\n```", ""),
]


@pytest.mark.parametrize(("md", "html"), TELEGRAM_CASES)
def test_telegram_html(md: str, html: str) -> None:
    assert to_telegram_html(md) == html
    assert telegram_errors(html) == []


@pytest.mark.parametrize(
    ("md", "plain"),
    [
        ("**b** _i_ ~~s~~ `c`", "b i s c"),
        (
            "[docs](https://x.io) and [x](javascript:void(0))",
            "docs (https://x.io) and [x](javascript:void(0))",
        ),
        ("# Head\n- item\n> quote\n```sh\nls <dir>\n```", "Head\n• item\n> quote\nls <dir>"),
        ("a < b & c", "a < b & c"),
    ],
)
def test_telegram_plain(md: str, plain: str) -> None:
    assert to_telegram_plain(md) == plain


def test_telegram_text_is_what_the_user_sees() -> None:
    assert telegram_text(to_telegram_html("**a** < [b](https://x.io) & `c`")) == "a < b & c"


SLACK_CASES = [
    ("a < b & c > d", "a &lt; b &amp; c &gt; d"),
    ("**b** __b2__ *i* _i2_ ~~s~~", "*b* *b2* _i_ _i2_ ~s~"),
    ("**bold *it**", "*bold *it*"),
    ("***both***", "*_both_*"),
    ("snake_case_name", "snake_case_name"),
    ("`**x** <y>`", "`**x** &lt;y&gt;`"),
    ("```js\nif (a && **b**) {}\n```", "```\nif (a &amp;&amp; **b**) {}\n```"),
    ("````md\n```\ninner\n```\n````", f"```\n`{ZWSP}`{ZWSP}`\ninner\n`{ZWSP}`{ZWSP}`\n```"),
    ("[docs](https://x.io/?a=1&b=2)", "<https://x.io/?a=1&amp;b=2|docs>"),
    ("[a *b*](https://x.io/p|q)", "<https://x.io/p%7Cq|a b>"),
    ("[mail](mailto:a@b.c)", "<mailto:a@b.c|mail>"),
    ("[x](javascript:alert(1))", "[x](javascript:alert(1))"),
    ("[x](https://x.io/<script>)", "<https://x.io/%3Cscript%3E|x>"),
    ("# Title", "*Title*"),
    ("## **Bold** title", "*Bold title*"),
    ("- one\n* two", "• one\n• two"),
    ("> quoted", "&gt; quoted"),
]


@pytest.mark.parametrize(("md", "mrkdwn"), SLACK_CASES)
def test_slack_mrkdwn(md: str, mrkdwn: str) -> None:
    assert to_slack_mrkdwn(md) == mrkdwn


DISCORD_CASES = [
    ("hi @everyone and @here", f"hi @{ZWSP}everyone and @{ZWSP}here"),
    ("```\n@everyone\n```", f"```\n@{ZWSP}everyone\n```"),
    ("mail me@here.com", f"mail me@{ZWSP}here.com"),
    ("# One\n## Two\n### Three", "# One\n## Two\n### Three"),
    ("#### Four\n###### Six ###", "**Four**\n**Six**"),
    ("#### A **bold** word", "**A bold word**"),
    ("```\n#### not a heading\n```", "```\n#### not a heading\n```"),
    ("**bold *it** a < b [x](javascript:y)", "**bold *it** a < b [x](javascript:y)"),
    # A mass mention in a fence's info string: the hint goes, the fence stays a fence (a
    # zero-width space would push a 40-character opener past what still counts as one).
    ("````<<<<<<<javascript:@everyone@everyone\nx\n````", "````\nx\n````"),
]


@pytest.mark.parametrize(("md", "out"), DISCORD_CASES)
def test_discord(md: str, out: str) -> None:
    assert to_discord(md) == out


# --- render_for edges -------------------------------------------------------------------------


def test_unknown_platform_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown platform"):
        render_for("irc", "hi")


def test_slack_escaping_growth_is_split_again() -> None:
    parts = render_for("slack", "&" * 4000)
    assert len(parts) > 1
    assert all(len(p) <= LIMITS["slack"] for p in parts)
    assert "".join(parts) == "&amp;" * 4000


def test_telegram_counts_utf16_units() -> None:
    parts = render_for("telegram", "\U0001f600" * 4000)
    assert len(parts) == 2
    assert all(measure("telegram", p) <= LIMITS["telegram"] for p in parts)


def test_discord_mentions_growth_stays_within_limit() -> None:
    parts = render_for("discord", "@everyone " * 400)
    assert all(len(p) <= LIMITS["discord"] for p in parts)
    assert sum(p.count("@\u200beveryone") for p in parts) == 400


@pytest.mark.parametrize("md", ["#", "```\n```", "> "])
def test_markup_with_nothing_to_show_is_sent_as_source(md: str) -> None:
    assert render_for("telegram", md) == [md.strip().replace(">", "&gt;")]
    assert render_for("slack", md) == [md.strip().replace(">", "&gt;")]
    assert render_for("discord", md) == [md.strip()]


# --- properties -------------------------------------------------------------------------------

# Each of these characters stands for a longer piece, so that plain st.text (fast to draw and
# to shrink, unlike a list of pieces) produces fences, links, mentions and very long lines.
EXPANSIONS: dict[str | int, str | int | None] = {
    "①": "```py\n",
    "②": "\n```\n",
    "③": "````",
    "④": "](https://x.io/a_b)",
    "⑤": "javascript:",
    "⑥": "@everyone",
    "⑦": "#### ",
    "⑧": "y" * 200,
    "⑨": "\n\n",
}
EXPAND = str.maketrans(EXPANSIONS)
CHARS = [*"*_~`[]()#>-<&", *"  \n\t", *"abcdefghij" * 2, "\U0001f600", "\u0301", "\u200d"]
CHARS += [str(c) for c in EXPANSIONS]
MARKDOWNISH = (
    st.integers(0, 800)
    .flatmap(lambda n: st.text(st.sampled_from(CHARS), min_size=n, max_size=n))
    .map(lambda s: s.translate(EXPAND))
)
PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(md=MARKDOWNISH, limit=st.integers(MIN_LIMIT, 1500))
def test_split_keeps_content_fits_and_balances_fences(md: str, limit: int) -> None:
    parts = split_markdown(md, limit)

    assert all(0 < len(p) <= limit for p in parts)
    assert all(p.strip() and p == p.strip("\n") for p in parts)
    assert all(p.split("\n")[0].strip() and p.split("\n")[-1].strip() for p in parts)
    assert content("\n".join(parts)) == content(md)
    assert bool(parts) == bool(md.strip())
    assert all(scan_lines(p)[-1].kind in (Kind.TEXT, Kind.CLOSE) for p in parts)  # no open fence


@PROPERTY
@given(md=MARKDOWNISH)
def test_render_never_raises_and_fits(md: str) -> None:
    for platform in PLATFORMS:
        parts = render_for(platform, md)
        assert bool(parts) == bool(md.strip())
        assert all(measure(platform, p) <= LIMITS[platform] for p in parts)
        if platform == "telegram":
            for part in parts:
                assert telegram_errors(part) == [], part
        else:
            assert all(scan_lines(p)[-1].kind is not Kind.CODE for p in parts)


@PROPERTY
@given(md=MARKDOWNISH)
def test_conversions_are_total(md: str) -> None:
    assert telegram_errors(to_telegram_html(md)) == []
    to_telegram_plain(md)
    to_slack_mrkdwn(md)
    assert "@everyone" not in to_discord(md)
