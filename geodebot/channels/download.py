"""What every adapter's download shares (the SDKs all sit on aiohttp): which hosts a file may
come from, and its body read with a cap."""

from __future__ import annotations

import io
from collections.abc import Collection

import aiohttp
import yarl

from geodebot.channels.base import FileTooLarge

CHUNK = 64 * 1024


async def read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The body, or FileTooLarge as soon as the answer announces (Content-Length) or
    delivers more than ``max_bytes``: leaving the response then closes the connection with
    the rest unread, so an oversized file is never held whole."""
    announced = response.content_length
    if announced is not None and announced > max_bytes:
        raise FileTooLarge(max_bytes, announced)
    # BytesIO hands its own buffer out as the bytes (getvalue() copies nothing when no view
    # of it is held), where bytes(bytearray) would copy: the file is held once, not twice.
    body = io.BytesIO()
    async for chunk in response.content.iter_chunked(CHUNK):
        body.write(chunk)
        if body.tell() > max_bytes:
            raise FileTooLarge(max_bytes)
    return body.getvalue()


def platform_host(url: yarl.URL, hosts: Collection[str], api_base: yarl.URL) -> bool:
    """Whether ``url`` is the platform's to serve: https on one of its ``hosts`` (port 443),
    or the same scheme, host and port as the configured API (a proxy, a test's fake). A URL
    with a user or password in it never is: what goes there is not the platform's choice."""
    if not url.is_absolute() or url.user is not None or url.password is not None:
        return False
    host = (url.host or "").lower()
    if url.scheme == "https" and host in hosts and url.port == 443:
        return True
    return (url.scheme, host, url.port) == (
        api_base.scheme,
        (api_base.host or "").lower(),
        api_base.port,
    )
