"""The systemd unit: one template, rendered for this installation by ``geodebot service install``.

``deploy/systemd/geodebot.service`` is this template rendered for the documented layout (a
venv in /opt/geodebot, configuration in /etc/geodebot); a test keeps the two equal.

Why each directive is what it is, against what the daemon does:

* ``Type=notify`` + ``NotifyAccess=main``: the daemon sends READY=1 once its store is open and
  every enabled channel connected, and WATCHDOG=1 from its event loop (``WatchdogSec``); no
  child ever speaks for it. ``TimeoutStartSec`` covers a platform that is slow to accept us.
* ``ExecReload=``: ``systemctl reload geodebot`` sends SIGHUP, on which the daemon reads
  the config again (bindings, jobs, budgets, pairing, log level; app/reload.py) and tells
  systemd RELOADING=1 then READY=1. A config that does not validate is refused whole.
* ``Restart=on-failure`` with a start limit: a crash or a tripped watchdog restarts it, a
  broken configuration (exit 2) five times in ten minutes stops trying.
* ``DynamicUser``, ``StateDirectory``, ``UMask=0077``: the daemon writes only its state
  directory (SQLite store, ledger, chat socket, workspace), readable by nobody else.
* ``LoadCredential``: API keys and tokens as files under ``$CREDENTIALS_DIRECTORY``, never in
  the environment or the config.
* ``RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6``: the chat socket and sd_notify are unix
  sockets; platforms and models are reached over IP. Nothing else.
* No capabilities, no new privileges, a read-only system, no home directories, private /tmp
  and devices, and a system call filter of ``@system-service`` minus privileged groups: the
  daemon is a network client that writes one directory. Computer use runs in a separate unit
  (``geodebot-desktop.service``) so this one keeps all of it.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterable
from pathlib import Path

from geodebot.config.schema import Config, secret_names

__all__ = [
    "CREDENTIALS_DIR",
    "DEFAULT_CONFIG",
    "DEFAULT_UNIT_PATH",
    "STATE_DIR",
    "current_executable",
    "layout_problems",
    "render_unit",
    "unit_for",
]

DEFAULT_CONFIG = Path("/etc/geodebot/config.toml")
DEFAULT_UNIT_PATH = Path("/etc/systemd/system/geodebot.service")
CREDENTIALS_DIR = Path("/etc/geodebot/credentials")
STATE_DIR = Path("/var/lib/geodebot")

_UNIT = """\
# geodebot as a system service: written by `geodebot service install` (see README, "Run as a
# service"). Secrets are files in {credentials}/, one per variable the config names.
[Unit]
Description=geodebot chat-ops agent daemon
After=network-online.target
Wants=network-online.target
StartLimitIntervalSec=10min
StartLimitBurst=5

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start}
ExecReload=/bin/kill -HUP $MAINPID
TimeoutStartSec=5min
TimeoutStopSec=90s
WatchdogSec=30s
Restart=on-failure
RestartSec=5s
RestartPreventExitStatus=2
DynamicUser=yes
StateDirectory=geodebot
StateDirectoryMode=0700
{load_credentials}{computer}
UMask=0077
NoNewPrivileges=yes
CapabilityBoundingSet=
AmbientCapabilities=
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
PrivateUsers=yes
PrivateIPC=yes
PrivateMounts=yes
ProtectHostname=yes
ProtectClock=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectProc=invisible
ProcSubset=pid
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
RemoveIPC=yes
KeyringMode=private
DevicePolicy=closed
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged @resources @mount @debug @cpu-emulation @obsolete @raw-io @reboot @swap @module @clock
SystemCallErrorNumber=EPERM

[Install]
WantedBy=multi-user.target
"""  # noqa: E501  # unit directives are one line each, however long


def current_executable() -> list[str]:
    """The command that starts this installation's geodebot (its venv's script if present)."""
    script = Path(sys.executable).parent / "geodebot"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "geodebot"]


def render_unit(
    command: Iterable[str],
    config_path: Path,
    secrets: Iterable[str],
    *,
    credentials: Path = CREDENTIALS_DIR,
    computer_use: bool = False,
) -> str:
    exec_start = shlex.join([*command, "serve", "--config", str(config_path)])
    names = sorted(set(secrets))
    load = "\n".join(f"LoadCredential={name}:{credentials / name}" for name in names)
    return _UNIT.format(
        exec_start=exec_start,
        load_credentials=load or "# No secrets named by the configuration.",
        credentials=credentials,
        # The desktop agent's socket (geodebot-desktop.service) is open to this group only.
        computer="\nSupplementaryGroups=geodebot-desktop" if computer_use else "",
    )


def unit_for(config: Config, config_path: Path) -> str:
    computer_use = config.tools.computer_socket is not None
    return render_unit(
        current_executable(), config_path, secret_names(config), computer_use=computer_use
    )


def layout_problems(config: Config) -> list[str]:
    """Settings that cannot work under the unit (whose system is read-only but for the state
    directory), each with its fix."""
    problems: list[str] = []
    # Under the unit $STATE_DIRECTORY decides the state directory; the workspace does not
    # follow it, so a relative one would land beside the config, in read-only /etc.
    workspace = config.tools.workspace
    if not workspace.is_absolute() or not workspace.is_relative_to(STATE_DIR):
        problems.append(
            f"tools.workspace is {str(workspace)!r}: under the service only {STATE_DIR} is "
            f'writable; set workspace = "{STATE_DIR / "workspace"}"'
        )
    return problems
