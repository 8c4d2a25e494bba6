"""Who may see the console and act in it: the bearer token, the console session and its
CSRF token, and the same-origin check every POST passes.

Nothing here is stored: a console session is a random id in a cookie, and its CSRF token is
an HMAC of that id under a key the daemon draws at start, so any number of browsers cost no
memory, and a restart simply asks the open pages to load the form again.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from urllib.parse import urlsplit

from aiohttp import web

SESSION_COOKIE = "geodebot_console"
TOKEN_COOKIE = "geodebot_token"
CSRF_FIELD = "csrf"
_SESSION_BYTES = 24
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _same(given: str, expected: str) -> bool:
    # aiohttp keeps undecodable header bytes as surrogates; they must compare (and fail)
    # like any other wrong value, not raise.
    return hmac.compare_digest(
        given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape")
    )


def own_origin(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


def same_origin(request: web.Request, public_origin: str | None = None) -> bool:
    """The request comes from a page of this console: its Origin is this server's own
    scheme://host or ``public_origin`` (the address a proxy serves it at) or, without an
    Origin header, its Referer is a page of either. Neither: no."""
    origin = request.headers.get("Origin")
    if origin is None:
        referer = request.headers.get("Referer")
        if not referer:
            return False
        parts = urlsplit(referer)
        origin = f"{parts.scheme}://{parts.netloc}"
    if _same(origin, own_origin(request)):
        return True
    return public_origin is not None and _same(origin, public_origin)


class Guard:
    """The bearer token (None: none configured), the names this server answers to, and the
    CSRF key of this daemon's run; ``public_origin``: ``[daemon] console_url`` when a proxy
    serves the console under an origin of its own."""

    def __init__(
        self,
        token: str | None,
        *,
        bound_host: str = "127.0.0.1",
        public_origin: str | None = None,
    ) -> None:
        self._token = token
        self._key = secrets.token_bytes(32)
        self._origin = public_origin
        public_host = urlsplit(public_origin).hostname if public_origin else None
        self._hosts = frozenset({bound_host.lower(), *LOOPBACK_NAMES, *filter(None, [public_host])})

    def host_ok(self, request: web.Request) -> bool:
        """Without a token, the console answers only to the loopback names and the address it
        is bound to: a page of another site whose name was made to resolve to 127.0.0.1 (DNS
        rebinding) is its own origin, so the origin check alone would let it read the pages
        and post their forms. With a token, that page has neither the header nor the cookie
        (cookies go by name), and a console behind a proxy may be called by any name."""
        if self._token is not None:
            return True
        host = request.url.host
        return host is not None and host.lower() in self._hosts

    def same_origin(self, request: web.Request) -> bool:
        return same_origin(request, self._origin)

    def secure(self, request: web.Request) -> bool:
        """Cookies are Secure when the browser reaches the console over TLS: directly, or
        through the proxy of an https ``console_url``."""
        return request.secure or (self._origin or "").startswith("https://")

    @property
    def needs_token(self) -> bool:
        return self._token is not None

    def token_ok(self, request: web.Request) -> bool:
        """No token configured, or the request carries it: as a bearer header or as the
        cookie the login form set."""
        if self._token is None:
            return True
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer ") and _same(header.removeprefix("Bearer "), self._token):
            return True
        cookie = request.cookies.get(TOKEN_COOKIE)
        return cookie is not None and _same(cookie, self._token)

    def token_matches(self, given: str) -> bool:
        return self._token is not None and _same(given, self._token)

    def set_token_cookie(self, request: web.Request, response: web.StreamResponse) -> None:
        assert self._token is not None
        set_cookie(response, TOKEN_COOKIE, self._token, secure=self.secure(request))

    # -- console session and CSRF ---------------------------------------------------------
    @staticmethod
    def session_of(request: web.Request) -> str | None:
        sid = request.cookies.get(SESSION_COOKIE)
        # Only ids this module could have made; anything else is treated as none.
        if sid is None or len(sid) != _SESSION_BYTES * 2 or not _is_hex(sid):
            return None
        return sid

    @staticmethod
    def new_session() -> str:
        return secrets.token_hex(_SESSION_BYTES)

    def set_session_cookie(
        self, request: web.Request, response: web.StreamResponse, sid: str
    ) -> None:
        set_cookie(response, SESSION_COOKIE, sid, secure=self.secure(request))

    def csrf_token(self, sid: str) -> str:
        return hmac.new(self._key, sid.encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, sid: str | None, given: str | None) -> bool:
        if sid is None or not given:
            return False
        return _same(given, self.csrf_token(sid))


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def set_cookie(response: web.StreamResponse, name: str, value: str, *, secure: bool) -> None:
    response.set_cookie(
        name,
        value,
        path="/",
        httponly=True,
        samesite="Strict",
        # Sent back over plain http too: the console is on loopback unless the operator put
        # it behind TLS, and then the cookie must not leave it.
        secure=secure,
    )
