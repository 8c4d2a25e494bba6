"""python-telegram-bot's network layer on aiohttp instead of httpx.

PTB lets the HTTP backend be replaced through ``telegram.request.BaseRequest``; its own
``HTTPXRequest`` runs every Bot API call through httpx, httpcore and anyio, which costs about
twice the CPU of the same call on aiohttp (``bench/telegram_bench.py`` profiles the daemon at
saturation). A daemon makes two or three Bot API calls per message, so this is where a busy
chat spends its time. aiohttp is already a dependency through discord.py and slack-bolt.

The wire format is PTB's: form fields (nested values JSON-encoded by ``RequestData``) and,
when files are attached, multipart. Errors become PTB's own ``TimedOut`` and ``NetworkError``,
so PTB's status and error handling above this class is unchanged. File downloads
(:meth:`AiohttpRequest.fetch`) stream with a cap instead of PTB's ``retrieve``, which holds
the whole body however large.
"""

from __future__ import annotations

import contextlib
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Final

import aiohttp
from telegram._utils.defaultvalue import DefaultValue
from telegram._utils.types import ODVInput
from telegram.error import NetworkError, TimedOut
from telegram.request import BaseRequest, RequestData

from geodebot.channels.download import read_capped

_UNSET: Final = BaseRequest.DEFAULT_NONE
# Of an error answer's body, enough for its description.
_ERROR_BODY_MAX: Final = 4096


class AiohttpRequest(BaseRequest):
    """One aiohttp session with a bounded connection pool.

    Timeouts mean what they mean for ``HTTPXRequest``: ``connect_timeout`` to open a
    connection, ``read_timeout`` between bytes of the answer, ``pool_timeout`` to wait for a
    free connection (aiohttp bounds the last two together). aiohttp has no write timeout;
    Bot API requests here are small forms.
    """

    def __init__(
        self,
        *,
        connection_pool_size: int = 1,
        read_timeout: float | None = 5.0,
        connect_timeout: float | None = 5.0,
        pool_timeout: float | None = 1.0,
    ) -> None:
        self._pool_size = connection_pool_size
        self._read_timeout = read_timeout
        self._connect_timeout = connect_timeout
        self._pool_timeout = pool_timeout
        self._session: aiohttp.ClientSession | None = None
        self._shut = False
        self._proxies: dict[tuple[str, str], str | None] = {}

    @property
    def read_timeout(self) -> float | None:
        return self._read_timeout

    async def initialize(self) -> None:
        self._shut = False
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._pool_size),
                # Not trust_env: aiohttp would then look up the proxy and ~/.netrc on a worker
                # thread for every request. The proxy is looked up once per host instead.
                trust_env=False,
                headers={"User-Agent": self.USER_AGENT},
            )

    async def shutdown(self) -> None:
        self._shut = True
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    def _proxy(self, url: str) -> str | None:
        """The proxy the environment (``https_proxy``, ``no_proxy``, ...) names for ``url``'s
        host, as httpx would use it; read once per host."""
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme, parts.hostname or "")
        if key not in self._proxies:
            bypass = not key[1] or urllib.request.proxy_bypass(key[1])
            self._proxies[key] = None if bypass else urllib.request.getproxies().get(key[0])
        return self._proxies[key]

    async def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None and not self._shut:
            # Usable before initialize(), like PTB's own backend: the session needs a loop.
            await self.initialize()
        session = self._session
        if session is None or session.closed:
            raise RuntimeError("This AiohttpRequest is shut down")
        return session

    async def post_json(self, url: str, payload: object, timeout_s: float) -> object:
        """POST ``payload`` as JSON and decode the answer, bypassing PTB's parsing (for a
        batch PTB cannot read). Raises NetworkError or TimedOut like a Bot API call."""
        session = await self._open_session()
        with _ptb_errors():
            async with session.post(
                url,
                json=payload,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                proxy=self._proxy(url),
            ) as response:
                return await response.json(content_type=None)

    async def fetch(self, url: str, max_bytes: int) -> tuple[int, bytes]:
        """GET ``url``: the status and the body, read as it arrives.

        Raises FileTooLarge when the answer announces (Content-Length) or delivers more than
        ``max_bytes``, as soon as it does: the rest is never read. An error status returns
        only the start of its body. Raises NetworkError or TimedOut like a Bot API call; the
        read timeout applies between chunks, so a large file on a slow link still arrives.
        """
        session = await self._open_session()
        pool, connect = self._pool_timeout, self._connect_timeout
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=None if pool is None or connect is None else pool + connect,
            sock_connect=connect,
            sock_read=self._read_timeout,
        )
        with _ptb_errors():
            async with session.get(url, timeout=timeout, proxy=self._proxy(url)) as response:
                if response.status != 200:
                    return response.status, await response.content.read(_ERROR_BODY_MAX)
                return response.status, await read_capped(response, max_bytes)

    async def do_request(
        self,
        url: str,
        method: str,
        request_data: RequestData | None = None,
        read_timeout: ODVInput[float] = _UNSET,
        write_timeout: ODVInput[float] = _UNSET,
        connect_timeout: ODVInput[float] = _UNSET,
        pool_timeout: ODVInput[float] = _UNSET,
    ) -> tuple[int, bytes]:
        session = await self._open_session()
        pool = _given(pool_timeout, self._pool_timeout)
        connect = _given(connect_timeout, self._connect_timeout)
        timeout = aiohttp.ClientTimeout(
            total=None,
            # aiohttp's ``connect`` covers the wait for a pooled connection *and* opening a
            # new one (TLS included), so it gets both budgets; ``sock_connect`` bounds the
            # opening alone, as PTB's connect timeout does.
            connect=None if pool is None or connect is None else pool + connect,
            sock_connect=connect,
            sock_read=_given(read_timeout, self._read_timeout),
        )
        body, headers = _body(request_data)
        with _ptb_errors():
            async with session.request(
                method, url, data=body, headers=headers, timeout=timeout, proxy=self._proxy(url)
            ) as response:
                return response.status, await response.read()


@contextlib.contextmanager
def _ptb_errors() -> Iterator[None]:
    """aiohttp's failures as PTB's: TimedOut, or NetworkError with the cause chained."""
    try:
        yield
    except TimeoutError as exc:  # aiohttp's own timeout errors are TimeoutErrors too
        raise TimedOut from exc
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: an answer not JSON
        raise NetworkError(f"aiohttp.{type(exc).__name__}: {exc}") from exc


def never_sent(exc: BaseException) -> bool:
    """True when PTB's error says the request never reached the server: no connection could
    be opened or taken from the pool. Anything else may have been acted on."""
    return isinstance(exc.__cause__, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)


def _given(value: ODVInput[float], default: float | None) -> float | None:
    return default if isinstance(value, DefaultValue) else value


_FORM: Final = {"Content-Type": "application/x-www-form-urlencoded"}


def _body(
    request_data: RequestData | None,
) -> tuple[aiohttp.FormData | str | None, dict[str, str] | None]:
    """PTB's parameters as a form, multipart when files go along (as PTB's own backend)."""
    if request_data is None:
        return None, None
    files = request_data.multipart_data
    if not files:
        # Encoded here: aiohttp would build a multipart writer first only to find no files.
        return urllib.parse.urlencode(request_data.json_parameters), _FORM
    form = aiohttp.FormData()
    for name, value in request_data.json_parameters.items():
        form.add_field(name, value)
    for name, upload in files.items():
        filename, content, *rest = upload
        content_type = rest[0] if rest else None
        form.add_field(name, content, filename=filename, content_type=content_type)
    return form, None
