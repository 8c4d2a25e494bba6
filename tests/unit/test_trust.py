from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest

from geodebot.config.schema import ConfigError
from geodebot.engine.mcp.trust import TrustStore, load_project_servers

PROJECT = """\
[[servers]]
name = "docs"
command = ["docs-mcp", "--stdio"]
env = ["DOCS_TOKEN"]

[servers.tools.search]
safety = "read"
effect = "none"
"""


@pytest.fixture
def store(tmp_path: Path) -> TrustStore:
    return TrustStore(tmp_path / "state" / "trust.json")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    path = tmp_path / "repo" / ".geodebot" / "mcp.toml"
    path.parent.mkdir(parents=True)
    path.write_text(PROJECT)
    return path


def test_untrusted_file_is_ignored_with_the_command_to_trust_it(
    store: TrustStore, project: Path
) -> None:
    servers, reason = load_project_servers(project, store)
    assert servers == []
    assert reason is not None
    assert "not trusted" in reason
    assert f"geodebot config trust {project}" in reason
    assert not store.is_trusted(project)


def test_trusted_file_is_used_and_the_entry_pins_its_content(
    store: TrustStore, project: Path
) -> None:
    entry = store.trust(project, by="alice")
    assert entry.path == str(project.resolve())
    assert entry.sha256 == hashlib.sha256(project.read_bytes()).hexdigest()
    assert entry.by == "alice"

    servers, reason = load_project_servers(project, store)
    assert reason is None
    assert [s.name for s in servers] == ["docs"]
    assert servers[0].command == ("docs-mcp", "--stdio")
    assert servers[0].tools["search"].safety == "read"
    assert store.is_trusted(project)
    # A second store over the same file sees the same decision: it is persisted.
    assert TrustStore(store.path).entries() == [entry]


def test_editing_after_trust_withdraws_it_until_trusted_again(
    store: TrustStore, project: Path
) -> None:
    store.trust(project, by="alice")
    project.write_text(PROJECT.replace('"read"', '"dangerous"'))

    servers, reason = load_project_servers(project, store)
    assert servers == []
    assert reason is not None
    assert "changed since alice trusted it" in reason
    assert not store.is_trusted(project)

    store.trust(project, by="bob")
    servers, reason = load_project_servers(project, store)
    assert reason is None
    assert servers[0].tools["search"].safety == "dangerous"


def test_trust_belongs_to_the_path_not_just_the_content(
    store: TrustStore, project: Path, tmp_path: Path
) -> None:
    store.trust(project, by="alice")
    copy = tmp_path / "elsewhere.toml"
    copy.write_bytes(project.read_bytes())
    assert not store.is_trusted(copy)
    link = tmp_path / "link.toml"
    link.symlink_to(project)
    assert store.is_trusted(link)


def test_revoke_forgets_the_file(store: TrustStore, project: Path) -> None:
    store.trust(project, by="alice")
    assert store.revoke(project) is True
    assert not store.is_trusted(project)
    assert store.entries() == []
    servers, reason = load_project_servers(project, store)
    assert servers == []
    assert reason is not None
    assert "not trusted" in reason
    assert store.revoke(project) is False


def test_store_file_is_private_and_written_without_leftovers(
    store: TrustStore, project: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other.toml"
    other.write_text(PROJECT)
    store.trust(project, by="alice")
    store.trust(other, by="alice")
    store.revoke(other)
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert [p.name for p in store.path.parent.iterdir()] == ["trust.json"]
    assert json.loads(store.path.read_text())["entries"][0]["path"] == str(project.resolve())


def test_invalid_file_cannot_be_trusted_and_names_the_problems(
    store: TrustStore, project: Path
) -> None:
    project.write_text(
        'project_config = "other.toml"\n[[servers]]\nname = "x"\ntransport = "http"\n'
    )
    with pytest.raises(ConfigError) as info:
        store.trust(project, by="alice")
    assert info.value.problems == [
        "project_config: unknown key",
        "servers.0: url is required for transport http",
    ]
    assert store.entries() == []


def test_trusted_but_invalid_file_is_ignored_with_the_problems(
    store: TrustStore, project: Path
) -> None:
    # As after an upgrade that tightened validation: the pin matches, the content no longer passes.
    project.write_text('[[servers]]\nname = "x"\ncommand = ["x"]\ncolour = "blue"\n')
    digest = hashlib.sha256(project.read_bytes()).hexdigest()
    store.path.parent.mkdir(parents=True)
    entry = {"path": str(project.resolve()), "sha256": digest, "by": "alice", "at": "then"}
    store.path.write_text(json.dumps({"version": 1, "entries": [entry]}))

    servers, reason = load_project_servers(project, store)
    assert servers == []
    assert reason is not None
    assert "trusted but invalid" in reason
    assert "servers.0.colour: unknown key" in reason


def test_unreadable_store_trusts_nothing(store: TrustStore, project: Path) -> None:
    store.trust(project, by="alice")
    store.path.write_text("{not json")
    assert not store.is_trusted(project)
    assert load_project_servers(project, store)[0] == []


def test_missing_project_file_is_reported(store: TrustStore, tmp_path: Path) -> None:
    servers, reason = load_project_servers(tmp_path / "absent.toml", store)
    assert servers == []
    assert reason is not None
    assert "cannot read" in reason
