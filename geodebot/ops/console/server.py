"""The Work console on the health server's aiohttp app: its routes, the checks every
request passes (token, console session, CSRF, same origin), and the rendering of pages.

Reads are plain GETs that change nothing and work without JavaScript. Every action is a
POST that carries the page's CSRF token and comes from a page of this console; it answers
with a redirect back to the page (and a flash message) or an error page that says why
nothing was done.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any
from urllib.parse import quote, unquote

import jinja2
from aiohttp import web

from geodebot.ops.console.actions import Refused
from geodebot.ops.console.parts import ConsoleParts, when
from geodebot.ops.console.routes import ACTIONS, PAGES, Action, NotFound, Page
from geodebot.ops.console.security import CSRF_FIELD, Guard, set_cookie
from geodebot.store.records import StoreError

log = logging.getLogger(__name__)
# The console session of the request at hand, set by the middleware for the handlers.
CONSOLE_SESSION = web.RequestKey("console_session", str)

FLASH_COOKIE = "geodebot_flash"
_STATIC_TYPES = {".css": "text/css", ".js": "text/javascript"}
_HEADERS = {
    # Every asset comes from this server; no inline script, no framing, forms post here only.
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # Same-origin requests carry the Referer the POST check may fall back on.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Console:
    """Adds the console to an aiohttp app (``install``); ``token``: the daemon's bearer
    token, None when none is configured; ``bound_host``: the host of ``[daemon] http``."""

    def __init__(
        self,
        parts: ConsoleParts,
        *,
        token: str | None = None,
        bound_host: str = "127.0.0.1",
        public_origin: str | None = None,
    ) -> None:
        self._parts = parts
        self._guard = Guard(token, bound_host=bound_host, public_origin=public_origin)
        self._env = jinja2.Environment(
            loader=jinja2.PackageLoader("geodebot.ops.console", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
            # Templates are read once, like the code they belong with: no stat per page.
            auto_reload=False,
        )
        self._env.filters["when"] = when
        self._env.filters["path"] = lambda text: quote(str(text), safe="/")
        self._nav = [(page.path, page.title) for page in PAGES if page.nav]
        self._static: dict[str, bytes] = {}
        self._own_paths: frozenset[str] = frozenset()

    def install(self, app: web.Application, own_paths: frozenset[str] = frozenset()) -> None:
        """Add the console's routes and checks to ``app``; ``own_paths`` are the server's
        own routes (health, metrics), which keep their own checks."""
        self._own_paths = own_paths
        app.middlewares.append(self._checks)
        router = app.router
        router.add_get("/", self._root)
        for page in PAGES:
            router.add_get(page.path, self._page_handler(page))
        for action in ACTIONS:
            router.add_post(action.path, self._action_handler(action))
        router.add_post("/login", self._login)
        router.add_get("/events", self._parts.live.stream)
        router.add_get("/static/{name}", self._asset)
        # Browsers ask for it on every page; there is none, and "none" needs no log line.
        router.add_get("/favicon.ico", _no_content)

        async def stop_streams(app: web.Application) -> None:
            self._parts.live.close()

        app.on_shutdown.append(stop_streams)

    # -- the checks -----------------------------------------------------------------------
    @web.middleware
    async def _checks(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in self._own_paths:
            return await handler(request)
        guard = self._guard
        if not guard.host_ok(request):
            log.warning("console: refused a request for host %r", request.host)
            return web.Response(
                status=421,
                text="This console answers only to its own address (or set http_token_env).",
            )
        sid = guard.session_of(request)
        fresh = sid is None
        session = sid if sid is not None else guard.new_session()
        request[CONSOLE_SESSION] = session
        if request.method == "POST":
            response = await self._post_checks(request, handler, None if fresh else sid)
        elif not guard.token_ok(request):
            response = self._render(request, "login.html", status=401, next=_local(request.path_qs))
        else:
            response = await handler(request)
        if fresh and not response.prepared:
            guard.set_session_cookie(request, response, session)
        if isinstance(response, web.Response):
            for name, value in _HEADERS.items():
                response.headers.setdefault(name, value)
        return response

    async def _post_checks(
        self, request: web.Request, handler: Handler, sid: str | None
    ) -> web.StreamResponse:
        if not self._guard.same_origin(request):
            return self._refusal(request, "The request did not come from a page of this console.")
        if request.path == "/login":
            return await handler(request)
        if not self._guard.token_ok(request):
            return self._refusal(request, "The console's token is needed for this.")
        form = await request.post()
        given = form.get(CSRF_FIELD)
        if not self._guard.csrf_ok(sid, given if isinstance(given, str) else None):
            return self._refusal(
                request, "The form's security token is missing or out of date: reload the page."
            )
        return await handler(request)

    def _refusal(self, request: web.Request, message: str, status: int = 403) -> web.Response:
        log.warning("console: refused %s %s: %s", request.method, request.path, message)
        return self._render(request, "error.html", status=status, message=message)

    # -- pages ----------------------------------------------------------------------------
    async def _root(self, request: web.Request) -> web.StreamResponse:
        return _redirect("/work", status=302)

    def _page_handler(self, page: Page) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                context = await page.load(self._parts, request)
            except NotFound as exc:
                return self._render(request, "error.html", status=404, message=str(exc))
            response = self._render(request, page.template, title=page.title, **context)
            flash = request.cookies.get(FLASH_COOKIE)
            if flash is not None:
                response.del_cookie(FLASH_COOKIE, path="/")
            return response

        return handle

    def _render(
        self, request: web.Request, template: str, *, status: int = 200, **context: Any
    ) -> web.Response:
        session = request.get(CONSOLE_SESSION, "")
        title = context.pop("title", "Console")
        flash = request.cookies.get(FLASH_COOKIE)
        body = self._env.get_template(template).render(
            nav=self._nav,
            path=request.path,
            here=request.raw_path,
            csrf=self._guard.csrf_token(session) if session else "",
            flash=unquote(flash) if flash else None,
            needs_token=self._guard.needs_token,
            title=title,
            **context,
        )
        return web.Response(text=body, status=status, content_type="text/html")

    async def _asset(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        kind = _STATIC_TYPES.get(name[name.rfind(".") :]) if "." in name else None
        if kind is None or "/" in name or name.startswith("."):
            raise web.HTTPNotFound()
        body = self._static.get(name)
        if body is None:
            try:
                body = (resources.files("geodebot.ops.console") / "static" / name).read_bytes()
            except (FileNotFoundError, IsADirectoryError):
                raise web.HTTPNotFound() from None
            self._static[name] = body
        return web.Response(body=body, content_type=kind, charset="utf-8")

    # -- actions --------------------------------------------------------------------------
    def _action_handler(self, action: Action) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            form = {k: v for k, v in (await request.post()).items() if isinstance(v, str)}
            back = _local(form.get("back", "")) or action.back
            try:
                message = await action.act(self._parts, request, form)
            except Refused as exc:
                return self._render(
                    request, "error.html", status=exc.status, message=str(exc), back=back
                )
            except StoreError as exc:
                log.error("console: %s failed: %s", request.path, exc)
                return self._render(
                    request, "error.html", status=503, message=f"The store failed: {exc}"
                )
            log.info("console: %s: %s", request.path, message)
            response = _redirect(back)
            set_cookie(response, FLASH_COOKIE, quote(message), secure=self._guard.secure(request))
            return response

        return handle

    async def _login(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        target = _local(str(form.get("next", ""))) or "/work"
        if not self._guard.needs_token:
            return _redirect(target)
        given = form.get("token")
        if not isinstance(given, str) or not self._guard.token_matches(given):
            return self._render(
                request, "login.html", status=403, next=target, wrong=True, title="Token"
            )
        response = _redirect(target)
        self._guard.set_token_cookie(request, response)
        return response


def _local(path: str) -> str:
    """``path`` if it is a path of this server ("/..."), else "": a form's ``back`` or
    ``next`` may send the browser only to a page of the console."""
    if path.startswith("/") and not path.startswith("//") and "\\" not in path:
        return path
    return ""


def _redirect(location: str, *, status: int = 303) -> web.Response:
    return web.Response(status=status, headers={"Location": location})


async def _no_content(request: web.Request) -> web.StreamResponse:
    return web.Response(status=204)
