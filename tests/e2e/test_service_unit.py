"""The systemd unit: hardened enough for `systemd-analyze security`, valid for `verify`, and
written for the installation that runs `geodebot service install`."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from geodebot.ops.systemd_unit import render_unit

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "geodebot.service"
EXPOSURE_MAX = 1.5


def systemd_analyze(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze is needed (Debian package systemd)"
    return subprocess.run(
        [tool, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def geodebot(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "geodebot", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def service_config(
    tmp_path: Path, workspace: str = "/var/lib/geodebot/workspace", computer_socket: str = ""
) -> Path:
    config = tmp_path / "config.toml"
    socket = f'computer_socket = "{computer_socket}"\n' if computer_socket else ""
    config.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "var"}"\n'
        '[model]\nprovider = "anthropic"\nname = "m"\napi_key_env = "ANTHROPIC_API_KEY"\n'
        f'[tools]\nworkspace = "{workspace}"\n{socket}'
        '[channels.telegram]\ntoken_env = "TELEGRAM_BOT_TOKEN"\n'
        "[channels.slack]\nenabled = false\n"
    )
    return config


def test_the_shipped_unit_is_the_template_for_the_documented_layout() -> None:
    rendered = render_unit(
        ["/opt/geodebot/bin/geodebot"], Path("/etc/geodebot/config.toml"), ["ANTHROPIC_API_KEY"]
    )
    assert UNIT.read_text() == rendered


def test_the_unit_scores_an_exposure_of_at_most_1_5() -> None:
    result = systemd_analyze("security", "--offline=yes", str(UNIT))
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match is not None, result.stdout + result.stderr
    assert float(match.group(1)) <= EXPOSURE_MAX, result.stdout


def test_install_writes_a_unit_for_this_installation_that_verifies(tmp_path: Path) -> None:
    config = service_config(tmp_path)
    out = tmp_path / "unit" / "geodebot.service"
    out.parent.mkdir()
    result = geodebot("service", "install", "--config", str(config), "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    assert "TELEGRAM_BOT_TOKEN" in result.stdout  # the credentials still to put in place
    unit = out.read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    command = exec_start.removeprefix("ExecStart=").split()
    assert command[0] == str(Path(sys.executable).parent / "geodebot")
    assert command[-3:] == ["serve", "--config", str(config.resolve())]
    credentials = sorted(line for line in unit.splitlines() if line.startswith("LoadCredential="))
    assert credentials == [
        "LoadCredential=ANTHROPIC_API_KEY:/etc/geodebot/credentials/ANTHROPIC_API_KEY",
        "LoadCredential=TELEGRAM_BOT_TOKEN:/etc/geodebot/credentials/TELEGRAM_BOT_TOKEN",
    ]
    verified = systemd_analyze("verify", out.name, cwd=out.parent)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert out.stat().st_mode & 0o777 == 0o644


def test_install_refuses_a_workspace_the_unit_cannot_write(tmp_path: Path) -> None:
    config = service_config(tmp_path, workspace="./workspace")
    out = tmp_path / "geodebot.service"
    result = geodebot("service", "install", "--config", str(config), "--output", str(out))
    assert result.returncode == 2
    assert "tools.workspace" in result.stderr
    assert "/var/lib/geodebot/workspace" in result.stderr
    assert not out.exists()


def test_print_writes_nothing(tmp_path: Path) -> None:
    config = service_config(tmp_path)
    result = geodebot("service", "install", "--config", str(config), "--print")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# geodebot as a system service")
    assert "Type=notify" in result.stdout
    assert "SupplementaryGroups" not in result.stdout
    computer = service_config(tmp_path, computer_socket="/run/geodebot-desktop/agent.sock")
    result = geodebot("service", "install", "--config", str(computer), "--print")
    assert result.returncode == 0, result.stderr
    assert "\nSupplementaryGroups=geodebot-desktop\n" in result.stdout


def test_the_desktop_unit_verifies(tmp_path: Path) -> None:
    desktop = ROOT / "deploy" / "systemd" / "geodebot-desktop.service"
    text = desktop.read_text().replace(
        "/opt/geodebot/bin/geodebot", str(Path(sys.executable).parent / "geodebot")
    )
    (tmp_path / desktop.name).write_text(text)
    verified = systemd_analyze("verify", desktop.name, cwd=tmp_path)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "-noreset" in text
    assert "RestrictAddressFamilies=AF_UNIX" in text
