"""The systemd notification protocol (sd_notify(3)) in a few lines, without libsystemd.

``NOTIFY_SOCKET`` names a unix datagram socket (a leading ``@`` is the abstract namespace);
each datagram is newline-separated ``KEY=value`` fields. Without ``NOTIFY_SOCKET`` (not run
by systemd, or ``Type=simple``) every call is a no-op.

The watchdog pings come from a task on the event loop, at half of ``WATCHDOG_USEC``: a loop
that blocks stops them, and systemd restarts the service, which is the point.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

__all__ = ["SystemdNotifier"]


class SystemdNotifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + raw[1:] if raw.startswith("@") else raw
        self._socket: socket.socket | None = None
        self._failed = False
        self.watchdog_interval_s: float | None = None
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process systemd watches; a child that inherited the
        # environment must not ping for its parent.
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval_s = int(usec) / 2 / 1_000_000

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, *fields: str) -> bool:
        """Send one datagram; False when there is no socket or it cannot be reached."""
        if not self._address:
            return False
        payload = "\n".join(f.replace("\n", " ") for f in fields).encode()
        try:
            if self._socket is None:
                self._socket = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                )
                # A full receive queue must not stall the event loop; a lost ping is one ping.
                self._socket.setblocking(False)
                self._socket.connect(self._address)
            self._socket.send(payload)
        except BlockingIOError:
            # systemd is not reading right now: this datagram is lost, the socket is fine.
            return False
        except OSError as exc:
            if not self._failed:
                log.warning("sd_notify: cannot reach %r: %s", self._address, exc)
            self._failed = True
            self.close()
            return False
        self._failed = False
        return True

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def stopping(self, status: str = "stopping") -> None:
        self.notify("STOPPING=1", f"STATUS={status}")

    async def run_watchdog(self, status: Callable[[], str] | None = None) -> None:
        """Ping until cancelled (returns at once without a watchdog), with the status line."""
        if self.watchdog_interval_s is None or not self.enabled:
            return
        last = ""
        while True:
            fields = ["WATCHDOG=1"]
            if status is not None:
                with contextlib.suppress(Exception):
                    line = status()
                    if line != last:
                        fields.append(f"STATUS={line}")
                        last = line
            self.notify(*fields)
            await asyncio.sleep(self.watchdog_interval_s)

    def close(self) -> None:
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.close()
