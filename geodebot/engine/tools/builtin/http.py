"""http_get: fetch text from an allowlisted host, never from a private address.

Each hop's host is checked against the allowlist, resolved once, and every address it
resolves to is vetted. The connection then goes only to those vetted addresses (a resolver
that answers from the vetted set), so a second, different DNS answer cannot redirect it.
"""

from __future__ import annotations

import asyncio
import codecs
import ipaddress
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from geodebot.engine.tools.spec import (
    DataClass,
    Effect,
    Safety,
    ToolCallContext,
    ToolError,
    ToolSpec,
)

if TYPE_CHECKING:
    from geodebot.engine.tools.builtin.settings import BuiltinSettings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_REDIRECTS = 5
MAX_URL_CHARS = 2048
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
TEXT_TYPES = frozenset(
    {
        "application/json",
        "application/xml",
        "application/javascript",
        "application/ecmascript",
        "application/x-javascript",
        "application/yaml",
        "application/x-yaml",
        "application/toml",
        "application/x-ndjson",
        "image/svg+xml",
    }
)
_NUMERIC = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV


def normalize_host(host: str) -> str:
    host = host.strip().strip("[]").rstrip(".").lower()
    try:
        return URL.build(scheme="http", host=host).raw_host or host
    except ValueError:
        return host


def host_allowed(host: str, patterns: tuple[str, ...]) -> bool:
    host = normalize_host(host)
    for raw in patterns:
        if raw.strip().startswith("*."):
            suffix = "." + normalize_host(raw.strip()[2:])
            if host.endswith(suffix) and len(host) > len(suffix) and _literal(host) is None:
                return True
        elif host == normalize_host(raw):
            return True
    return False


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def address_is_public(addr: IPAddress) -> bool:
    if isinstance(addr, ipaddress.IPv6Address):
        # An IPv6 form that embeds an IPv4 address is judged by that address.
        embedded = addr.ipv4_mapped or addr.sixtofour
        if embedded is not None:
            return address_is_public(embedded)
        if addr.is_site_local:
            return False
    return addr.is_global and not (
        addr.is_private
        or addr.is_loopback
        or addr.is_link_local
        or addr.is_multicast
        or addr.is_reserved
        or addr.is_unspecified
    )


async def resolve_host(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _PinnedResolver(AbstractResolver):
    """Answers only with addresses vetted for this request; never asks DNS."""

    def __init__(self) -> None:
        self.pins: dict[str, list[IPAddress]] = {}

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results: list[ResolveResult] = []
        for addr in self.pins.get(normalize_host(host), []):
            fam = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
            if family in (socket.AF_UNSPEC, fam):
                results.append(
                    ResolveResult(
                        hostname=host,
                        host=str(addr),
                        port=port,
                        family=fam,
                        proto=0,
                        flags=_NUMERIC,
                    )
                )
        if not results:
            raise OSError(f"{host} has no vetted address")
        return results

    async def close(self) -> None:
        pass


async def _vet(url: URL, settings: BuiltinSettings) -> tuple[str, list[IPAddress]]:
    host = _vet_url(url, settings)
    addrs = await _addresses(host, url.port or 0)
    if not settings.http_allow_private:
        for addr in addrs:
            if not address_is_public(addr):
                raise ToolError(f"{host} resolves to a non-public address ({addr}); refused")
    return host, addrs


def _vet_url(url: URL, settings: BuiltinSettings) -> str:
    """The URL's host, once the scheme, credentials and allowlist say it may be asked."""
    if url.scheme not in ("http", "https"):
        raise ToolError(f"only http and https URLs are allowed, not {url.scheme or 'none'!r}")
    if not url.raw_host:
        raise ToolError("the URL has no host")
    if url.raw_user is not None or url.raw_password is not None:
        raise ToolError("URLs with credentials are refused")
    host = normalize_host(url.raw_host)
    if not host_allowed(host, settings.http_allow_hosts):
        raise ToolError(f"host {host} is not on the http allowlist")
    return host


async def _addresses(host: str, port: int) -> list[IPAddress]:
    literal = _literal(host)
    if literal is not None:
        return [literal]
    try:
        found = await resolve_host(host, port)
    except OSError as exc:
        raise ToolError(f"cannot resolve {host}: {exc}") from None
    addrs = [ipaddress.ip_address(a.split("%", 1)[0]) for a in found]
    if not addrs:
        raise ToolError(f"{host} resolved to no address")
    return addrs


def _is_text(content_type: str) -> bool:
    return (
        content_type.startswith("text/")
        or content_type in TEXT_TYPES
        or content_type.endswith(("+json", "+xml"))
    )


async def _read_capped(content: aiohttp.StreamReader, limit: int) -> tuple[bytes, bool]:
    body = bytearray()
    while len(body) <= limit:
        chunk = await content.read(min(65536, limit + 1 - len(body)))
        if not chunk:
            return bytes(body), False
        body += chunk
    return bytes(body[:limit]), True


async def _render(resp: aiohttp.ClientResponse, url: URL, limit: int) -> str:
    header = (
        f"status: {resp.status} {resp.reason or ''}".rstrip()
        + f"\ncontent-type: {resp.headers.get('Content-Type', '(none)')}\nurl: {url}\n"
    )
    if not _is_text(resp.content_type):
        raise ToolError(header + "body not returned: not a text content type")
    body, truncated = await _read_capped(resp.content, limit)
    try:
        decoder = codecs.getincrementaldecoder(resp.charset or "utf-8")(errors="replace")
    except LookupError:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    # final=False on a cut body drops a half-read multibyte character instead of garbling it.
    text = decoder.decode(body, final=not truncated)
    note = f"\n[truncated: the body is longer than {limit} bytes]" if truncated else ""
    return f"{header}\n{text}{note}"


async def fetch(url_text: str, settings: BuiltinSettings) -> str:
    if not settings.http_allow_hosts:
        raise ToolError("http_get is disabled: the http allowlist is empty")
    try:
        url = URL(url_text)
    except (ValueError, TypeError):
        raise ToolError("not a valid URL") from None
    if not url.absolute and url.scheme in ("", "http", "https"):
        raise ToolError("the URL must be absolute (http:// or https://)")
    resolver = _PinnedResolver()
    connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False, force_close=True)
    try:
        async with (
            asyncio.timeout(settings.http_timeout_s),
            aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                headers={"User-Agent": "geodebot-http_get", "Accept-Encoding": "identity"},
                timeout=aiohttp.ClientTimeout(total=settings.http_timeout_s),
            ) as session,
        ):
            for _ in range(MAX_REDIRECTS + 1):
                host, addrs = await _vet(url, settings)
                resolver.pins[host] = addrs
                async with session.get(url, allow_redirects=False) as resp:
                    location = resp.headers.get("Location")
                    if resp.status not in REDIRECT_STATUSES or location is None:
                        return await _render(resp, url, settings.http_max_bytes)
                try:
                    url = url.join(URL(location))
                except ValueError:
                    raise ToolError(f"invalid redirect location {location[:200]!r}") from None
            raise ToolError(f"too many redirects (more than {MAX_REDIRECTS})")
    except TimeoutError:
        raise ToolError(f"http_get timed out after {settings.http_timeout_s:g} s") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise ToolError(f"request failed: {type(exc).__name__}: {exc}") from None
    finally:
        await connector.close()


def http_get_tool(settings: BuiltinSettings) -> ToolSpec:
    async def http_get(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        url = arguments.get("url")
        if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
            raise ToolError(f"url must be a string of 1 to {MAX_URL_CHARS} characters")
        return await fetch(url, settings)

    allowed = ", ".join(settings.http_allow_hosts) or "none (http_get is disabled)"
    return ToolSpec(
        name="http_get",
        description=(
            "GET an http(s) URL and return its status, content type and text body (at most "
            f"{settings.http_max_bytes} bytes; redirects are followed). Allowed hosts: {allowed}."
        ),
        input_schema={
            "type": "object",
            "properties": {"url": {"type": "string", "minLength": 1, "maxLength": MAX_URL_CHARS}},
            "required": ["url"],
            "additionalProperties": False,
        },
        safety=Safety.READ,
        effect=Effect.NONE,
        handler=http_get,
        resource_keys=("net",),
        # Above the request's own deadline, so the clearer message from fetch() wins.
        timeout_s=settings.http_timeout_s + 5,
        data_class=DataClass.PUBLIC,
    )
