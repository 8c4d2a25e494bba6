from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomli as tomllib

from geodebot.config.schema import (
    ConfigError,
    config_path,
    load_config,
    parse_config,
    resolve_secret,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "config.example.toml"


def problems_of(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value.problems


def test_example_config_loads_with_its_documented_defaults() -> None:
    config = load_config(EXAMPLE)
    assert config.model.provider == "anthropic"
    assert config.model.fallbacks == ()
    assert config.model.key_env == "ANTHROPIC_API_KEY"
    assert config.state_dir == EXAMPLE.parent / "var"


def test_empty_config_is_valid_and_has_no_fallbacks() -> None:
    config = parse_config({})
    assert config.model.fallbacks == ()
    assert config.budgets.repair_budget == 2


def test_bad_provider_names_key_and_choices(tmp_path: Path) -> None:
    assert problems_of('[model]\nprovider = "gemini"\n', tmp_path) == [
        "model.provider: must be one of anthropic, openai, openai-compatible"
    ]


def test_every_problem_gets_its_own_line(tmp_path: Path) -> None:
    text = """
[daemon]
state_dirr = "x"
[model]
max_retries = -1
name = ""
[budgets]
daemon_time_s = "soon"
"""
    problems = problems_of(text, tmp_path)
    assert "daemon.state_dirr: unknown key" in problems
    assert any(p.startswith("model.max_retries: ") for p in problems)
    assert any(p.startswith("model.name: ") for p in problems)
    assert any(p.startswith("budgets.daemon_time_s: ") for p in problems)
    assert len(problems) == 4


def test_unknown_top_level_table(tmp_path: Path) -> None:
    assert problems_of("[modle]\nname='x'\n", tmp_path) == ["modle: unknown key"]


def test_openai_compatible_requires_base_url(tmp_path: Path) -> None:
    problems = problems_of('[model]\nprovider = "openai-compatible"\nname = "llama3"\n', tmp_path)
    assert problems == ["model: base_url is required when provider is openai-compatible"]


def test_fallback_errors_name_their_index(tmp_path: Path) -> None:
    text = '[model]\n[[model.fallbacks]]\nprovider = "openai"\nname = "gpt-4.1"\n'
    text += '[[model.fallbacks]]\nprovider = "nope"\n'
    assert problems_of(text, tmp_path) == [
        "model.fallbacks.1.provider: must be one of anthropic, openai, openai-compatible"
    ]


def test_prompt_source_needs_exactly_one_kind(tmp_path: Path) -> None:
    text = '[[prompt.sources]]\ntext = "a"\nfile = "b.md"\n'
    assert problems_of(text, tmp_path) == ["prompt.sources.0: give exactly one of text or file"]


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    problems = problems_of("[model\n", tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("invalid TOML")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.toml")
    assert info.value.problems == ["file not found"]


def test_state_directory_from_systemd_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/geodebot:/var/lib/other")
    assert str(load_config(EXAMPLE).state_dir) == "/var/lib/geodebot"


def test_config_path_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GEODEBOT_CONFIG", raising=False)
    assert str(config_path(None)) == "/etc/geodebot/config.toml"
    monkeypatch.setenv("GEODEBOT_CONFIG", "/tmp/x.toml")
    assert str(config_path(None)) == "/tmp/x.toml"
    assert str(config_path("mine.toml")) == "mine.toml"


def test_secret_from_env_then_credentials_directory(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "ANTHROPIC_API_KEY").write_text("from-credential\n")
    env = {"CREDENTIALS_DIRECTORY": str(creds)}
    assert resolve_secret("ANTHROPIC_API_KEY", env) == "from-credential"
    env["ANTHROPIC_API_KEY"] = "from-env"
    assert resolve_secret("ANTHROPIC_API_KEY", env) == "from-env"
    # An empty variable is a missing secret, not an empty key.
    assert resolve_secret("OTHER", {"OTHER": ""}) is None
    assert resolve_secret("OTHER", env) is None


def test_job_errors_name_the_job_and_key(tmp_path: Path) -> None:
    binding = '[[bindings]]\nplatform = "telegram"\nchannel = "1"\nsession = "ops"\n'
    assert problems_of(
        binding + '[[jobs]]\nid = "a"\nprompt = "p"\ndeliver_to = "ops"\n', tmp_path
    ) == ["jobs.0: give exactly one of cron, every or at"]
    assert problems_of(
        binding + '[[jobs]]\nid = "a"\nevery = "1h"\nprompt = "p"\ndeliver_to = "dev"\n', tmp_path
    ) == ["jobs.0.deliver_to: 'dev' is not the session of a binding"]
    assert problems_of(
        binding
        + '[[jobs]]\nid = "a"\nevery = "soon"\nprompt = "p"\ndeliver_to = "ops"\n'
        + 'timezone = "Mars/Base"\ncatch_up = "never"\nat = "yesterday"\n',
        tmp_path,
    ) == [
        "jobs.0.every: 'soon' is not a duration like 90s, 15m, 2h or 1d",
        "jobs.0.at: 'yesterday' is not an ISO 8601 date and time",
        "jobs.0.timezone: unknown timezone 'Mars/Base' (an IANA name like Europe/Berlin)",
        "jobs.0.catch_up: must be one of latest, skip, all",
    ]
    job = '[[jobs]]\nid = "a"\nevery = "1h"\nprompt = "p"\ndeliver_to = "ops"\n'
    assert problems_of(binding + job + job, tmp_path) == ["jobs.1.id: 'a' twice"]
    assert problems_of('[daemon]\ntimezone = "Nowhere"\n', tmp_path) == [
        "daemon.timezone: unknown timezone 'Nowhere' (an IANA name like Europe/Berlin)"
    ]


def test_job_defaults() -> None:
    config = parse_config(
        {
            "daemon": {"timezone": "Europe/Berlin"},
            "bindings": [{"platform": "telegram", "channel": "1", "session": "ops"}],
            "jobs": [{"id": "j", "every": "15m", "prompt": "p", "deliver_to": "ops"}],
        }
    )
    job = config.jobs[0]
    assert job.session_id == "job:j"
    assert job.catch_up == "latest"
    assert job.notify_on_failure is True
    assert job.timezone is None


def example_block(table: str) -> dict[str, Any]:
    """A commented table of config.example.toml, uncommented and parsed."""
    lines = EXAMPLE.read_text().splitlines()
    start = lines.index(f"# [{table}]")
    block = []
    for line in lines[start:]:
        if not line.startswith("#"):
            break
        block.append(line.removeprefix("# "))
    return tomllib.loads("\n".join(block))


def test_the_examples_pairing_table_uncommented_is_valid() -> None:
    config = parse_config(example_block("pairing"))
    assert config.pairing.enabled
    assert (config.pairing.code_ttl_s, config.pairing.max_pending) == (3600, 10)
    assert config.pairing.tools == ()
    assert not config.pairing.groups
    # Absent, pairing is off.
    assert not parse_config({}).pairing.enabled


def test_the_examples_voice_table_uncommented_is_valid() -> None:
    config = parse_config(example_block("voice"))
    voice = config.voice
    assert voice is not None
    assert voice.transcribe_url == "http://127.0.0.1:8000/v1"
    assert voice.speech_url == "http://127.0.0.1:8880/v1"
    assert (voice.max_seconds, voice.max_speech_chars) == (300, 1500)
    # Absent, voice is off.
    assert parse_config({}).voice is None


def test_the_examples_memory_table_uncommented_is_valid() -> None:
    memory = parse_config(example_block("memory")).memory
    assert (memory.enabled, memory.max_items, memory.max_item_chars) == (True, 5000, 2000)
    assert (memory.recall, memory.recall_max_tokens) == (0, 800)
    assert memory.save_from == ("chat", "relay", "job", "terminal")
