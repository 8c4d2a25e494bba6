"""A file's body from an aiohttp response, read with a cap: what every adapter's download
shares (the SDKs all sit on aiohttp)."""

from __future__ import annotations

import aiohttp

from geodebot.channels.base import FileTooLarge

CHUNK = 64 * 1024


async def read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The body, or FileTooLarge as soon as the answer announces (Content-Length) or
    delivers more than ``max_bytes``: leaving the response then closes the connection with
    the rest unread, so an oversized file is never held whole."""
    announced = response.content_length
    if announced is not None and announced > max_bytes:
        raise FileTooLarge(max_bytes, announced)
    body = bytearray()
    async for chunk in response.content.iter_chunked(CHUNK):
        body += chunk
        if len(body) > max_bytes:
            raise FileTooLarge(max_bytes)
    return bytes(body)
