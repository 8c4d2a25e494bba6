"""The providers' prompt caches as :class:`~tests.support.fakes.llm_server.FakeLLMServer`
models them, so a test sees what a client's requests would be billed as.

Anthropic (explicit breakpoints, as documented): a prompt is its blocks in order: the tools,
the system prompt's blocks, then every message's content blocks. A block with
``cache_control`` is a breakpoint: the prefix ending with it is written to the cache. A
request reads the longest cached prefix that ends at one of its breakpoints or at one of the
20 blocks before each breakpoint; it pays the cache-write rate for the tokens from there to
its last breakpoint, and the full rate for the rest. Prefixes shorter than ``min_tokens`` are
not cached. A block's tokens here are the length of its JSON (``cache_control`` left out)
divided by four.

OpenAI (automatic): the longest prefix, in characters of the serialized messages, shared with
any earlier request of at least ``min_tokens`` tokens, reported as
``prompt_tokens_details.cached_tokens`` (in the same four-character tokens).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["PromptCache"]

LOOKBACK_BLOCKS = 20


def _bare(block: Any) -> Any:
    """A block as the cache sees it: where the breakpoints are is not part of the prompt."""
    if isinstance(block, dict):
        return {k: v for k, v in block.items() if k != "cache_control"}
    return block


def _tokens(block: Any) -> int:
    return max(1, len(json.dumps(block, sort_keys=True, separators=(",", ":"))) // 4)


def _blocks(body: dict[str, Any]) -> list[tuple[Any, bool]]:
    """(block, is a breakpoint) in prompt order."""
    found: list[tuple[Any, bool]] = []
    for tool in body.get("tools") or ():
        found.append((tool, isinstance(tool, dict) and "cache_control" in tool))
    system = body.get("system")
    if isinstance(system, str):
        found.append(({"type": "text", "text": system}, False))
    elif isinstance(system, list):
        found.extend((b, isinstance(b, dict) and "cache_control" in b) for b in system)
    for message in body.get("messages") or ():
        content = message.get("content")
        if isinstance(content, str):
            found.append(({"role": message.get("role"), "text": content}, False))
            continue
        for block in content or ():
            marked = isinstance(block, dict) and "cache_control" in block
            found.append(({"role": message.get("role"), **block}, marked))
    return found


class PromptCache:
    def __init__(self, *, min_tokens: int = 0) -> None:
        self.min_tokens = min_tokens
        self._anthropic: set[str] = set()
        self._openai: list[str] = []
        # Every breakpoint count seen, for tests that check the API's limit of four.
        self.breakpoints: list[int] = []

    def anthropic(self, body: dict[str, Any]) -> tuple[int, int, int]:
        """(input tokens at the full rate, cache writes, cache reads) of one request."""
        blocks = _blocks(body)
        marks = [i for i, (_, marked) in enumerate(blocks) if marked]
        self.breakpoints.append(len(marks))
        digest = hashlib.sha256()
        keys: list[str] = []
        ends: list[int] = []  # tokens up to and including block i
        total = 0
        for marked_block, _ in blocks:
            block = _bare(marked_block)
            digest.update(json.dumps(block, sort_keys=True).encode())
            keys.append(digest.copy().hexdigest())
            total += _tokens(block)
            ends.append(total)
        read_to = -1
        for mark in marks:
            for i in range(mark, max(-1, mark - LOOKBACK_BLOCKS - 1), -1):
                if keys[i] in self._anthropic:
                    read_to = max(read_to, i)
                    break
        read = ends[read_to] if read_to >= 0 else 0
        written = 0
        if marks and marks[-1] > read_to:
            for mark in marks:
                if mark > read_to and ends[mark] >= self.min_tokens:
                    self._anthropic.add(keys[mark])
            last = marks[-1]
            if ends[last] >= self.min_tokens:
                written = ends[last] - read
        return total - read - written, written, read

    def openai(self, body: dict[str, Any]) -> tuple[int, int]:
        """(prompt tokens, of which cached) of one request."""
        text = json.dumps(body.get("messages"), sort_keys=True, separators=(",", ":"))
        best = 0
        for earlier in self._openai:
            n = 0
            limit = min(len(text), len(earlier))
            while n < limit and text[n] == earlier[n]:
                n += 1
            best = max(best, n)
        self._openai.append(text)
        prompt = max(1, len(text) // 4)
        cached = best // 4
        return prompt, cached if cached >= self.min_tokens else 0
