"""What a config reload applies and what it leaves for a restart (app/reload.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from geodebot.app.reload import restart_only_changes
from geodebot.config.schema import load_config, parse_config

BASE = {
    "daemon": {"state_dir": "/var/lib/a", "log_level": "info"},
    "channels": {"telegram": {"token_env": "T"}},
    "bindings": [{"platform": "telegram", "channel": "1", "session": "s"}],
}


def changed(**tables: object) -> list[str]:
    return restart_only_changes(parse_config(BASE), parse_config({**BASE, **tables}))


def test_reloadable_keys_are_not_named_and_the_others_are_by_their_key() -> None:
    assert changed() == []
    assert (
        changed(
            bindings=[
                {"platform": "telegram", "channel": "2", "session": "t", "tools": ["get_time"]}
            ],
            budgets={"daemon_time_s": 30},
            pairing={"enabled": True, "max_pending": 3},
            daemon={"state_dir": "/var/lib/a", "log_level": "debug"},
        )
        == []
    )
    assert changed(
        daemon={"state_dir": "/var/lib/b", "log_level": "debug", "http": "127.0.0.1:9000"},
        channels={"telegram": {"token_env": "OTHER"}},
        store={"url": "postgresql://db/geodebot"},
    ) == [
        "channels.telegram.token_env",
        "daemon.http",
        "daemon.state_dir",
        "store.url",
    ]


def test_the_file_hash_is_of_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(b'[daemon]\nlog_level = "debug"\n')
    assert load_config(path).digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert parse_config({}).digest == ""
