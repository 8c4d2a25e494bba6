"""``geodebot jobs ...`` as an operator runs it, against the store with no daemon running."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from geodebot.config.schema import DB_FILE
from geodebot.store.records import JobRecord
from geodebot.store.sqlite import SQLiteStore
from tests.support.cli import geodebot, write_config

BINDING = '[[bindings]]\nplatform = "telegram"\nchannel = "-100"\nsession = "ops"\n'
CONFIG_JOB = (
    '[[jobs]]\nid = "nightly"\ncron = "0 3 * * *"\nprompt = "Report."\ndeliver_to = "ops"\n'
)


async def jobs(config: Path, *args: str) -> tuple[int, str, str]:
    return await geodebot("jobs", *args, "--config", str(config))


async def stored(tmp_path: Path, job_id: str) -> JobRecord:
    async with SQLiteStore(tmp_path / "var" / DB_FILE) as store:
        job = await store.job_get(job_id)
    assert job is not None
    return job


async def test_jobs_add_list_pause_resume_run_history_remove(tmp_path: Path) -> None:
    config = write_config(tmp_path, BINDING + CONFIG_JOB)
    code, out, err = await jobs(
        config, "add", "hourly", "--every", "1h", "--prompt", "Status?", "--deliver-to", "ops",
        "--tool", "get_time", "--timezone", "Europe/Berlin", "--catch-up", "skip",
    )  # fmt: skip
    assert code == 0, err
    assert "every 1h (Europe/Berlin)" in out
    assert out.count("+01:00") == 3

    code, out, err = await jobs(config, "list")
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"hourly", "nightly"}
    assert "config" in rows["nightly"]
    assert "T03:00:00+00:00" in rows["nightly"]
    assert "never fired" in rows["hourly"]

    paused, requested = await asyncio.gather(
        jobs(config, "pause", "hourly"), jobs(config, "run", "hourly")
    )
    assert paused[0] == 0
    code, out, _ = await jobs(config, "show", "hourly")
    shown = json.loads(out)
    assert shown["paused"] is True
    assert shown["next_fire"] == "paused"
    assert shown["tools"] == ["get_time"]
    assert shown["catch_up"] == "skip"
    assert shown["creator"].startswith("cli:")
    assert (await jobs(config, "resume", "hourly"))[0] == 0
    code, out, _ = await jobs(config, "show", "hourly")
    assert json.loads(out)["paused"] is False

    assert requested[0] == 0, requested[2]
    assert "requested" in requested[1]
    code, out, _ = await jobs(config, "history", "hourly")
    assert code == 0
    assert "manual" in out.splitlines()[1]
    assert "requested" in out.splitlines()[1]

    (code, _, err), removed = await asyncio.gather(
        jobs(config, "remove", "nightly"), jobs(config, "remove", "hourly")
    )
    assert code == 1
    assert "defined in the config file" in err
    assert removed[0] == 0
    (code, out, _), (_, history, _) = await asyncio.gather(
        jobs(config, "list"), jobs(config, "history", "hourly")
    )
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["nightly"]
    # A removed job's history stays readable.
    assert "was removed" in history
    assert "manual" in history


async def test_jobs_usage_errors_are_exit_2_and_unknown_ids_exit_1(tmp_path: Path) -> None:
    config = write_config(tmp_path, BINDING)
    add = ("add", "x", "--prompt", "p")
    # Independent commands run side by side to keep the test short.
    bad_target, bad_cron, two_schedules, *ghosts = await asyncio.gather(
        jobs(config, *add, "--cron", "0 9 * *", "--deliver-to", "nowhere", "--tool", "run_bash"),
        jobs(config, *add, "--cron", "0 9 * *", "--deliver-to", "ops"),
        jobs(config, *add, "--every", "1h", "--at", "2030-01-01T00:00", "--deliver-to", "ops"),
        *(jobs(config, action, "ghost") for action in ("show", "pause", "run", "history")),
    )
    code, _, err = bad_target
    assert code == 2
    assert "--deliver-to: 'nowhere' is not the session of a binding" in err
    assert "--tool run_bash: never available in daemon mode" in err
    assert "Traceback" not in err
    code, _, err = bad_cron
    assert code == 2
    assert "has 4 fields" in err
    assert two_schedules[0] == 2
    for code, _, err in ghosts:
        assert code == 1
        assert "no job 'ghost'" in err


async def test_job_config_errors_name_the_key(tmp_path: Path) -> None:
    body = (
        BINDING
        + '[[jobs]]\nid = "a"\ncron = "0 61 * * *"\nprompt = "p"\ndeliver_to = "ops"\n'
        + '[[jobs]]\nid = "b"\nevery = "1h"\nprompt = "p"\ndeliver_to = "ops"\n'
        + 'tools = ["run_bash", "nope"]\n'
    )
    config = write_config(tmp_path, body)
    (code, _, err), (list_code, _, list_err) = await asyncio.gather(
        geodebot("serve", "--config", str(config)), jobs(config, "list")
    )
    assert code == 2
    assert "jobs.0.cron: '0 61 * * *' is not a valid cron expression" in err
    assert "jobs.1.tools: run_bash: never available in daemon mode" in err
    assert "jobs.1.tools: nope: no such tool" in err
    assert "Traceback" not in err
    assert list_code == 2
    assert "jobs.0.cron" in list_err


SHARED = BINDING + '[[bindings]]\nplatform = "slack"\nchannel = "C7"\nsession = "ops"\n'


async def test_a_cli_job_gets_a_session_of_its_own_and_names_its_binding(tmp_path: Path) -> None:
    config = write_config(tmp_path, SHARED)
    add = ("add", "h", "--every", "1h", "--prompt", "p", "--deliver-to", "ops")
    (unnamed, _, unnamed_err), (wrong, _, wrong_err), (code, _, err) = await asyncio.gather(
        jobs(config, *add),
        jobs(config, *add, "--deliver-binding", "slack:C8"),
        jobs(config, *add, "--deliver-binding", "slack:C7"),
    )
    assert unnamed == 2
    assert "--deliver-to: the session 'ops' is shared by telegram:-100, slack:C7" in unnamed_err
    assert "--deliver-binding" in unnamed_err
    assert wrong == 2
    assert "--deliver-binding: 'slack:C8' is not a binding" in wrong_err
    assert code == 0, err
    first = await stored(tmp_path, "h")
    assert first.deliver_binding == "slack:C7"
    assert first.session_id.startswith("job:h:")
    assert (await jobs(config, "remove", "h"))[0] == 0
    code, _, err = await jobs(config, *add, "--deliver-binding", "telegram:-100")
    assert code == 0, err
    second = await stored(tmp_path, "h")
    assert second.deliver_binding == "telegram:-100"
    # The same id again is another job: it does not continue the removed one's session.
    assert second.session_id.startswith("job:h:")
    assert second.session_id != first.session_id


async def test_a_config_job_on_a_shared_session_must_name_its_binding(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ambiguous = write_config(tmp_path / "a", SHARED + CONFIG_JOB)
    named = write_config(tmp_path / "b", SHARED + CONFIG_JOB + 'deliver_binding = "slack:C7"\n')
    (code, _, err), (ok, out, ok_err) = await asyncio.gather(
        jobs(ambiguous, "list"), jobs(named, "show", "nightly")
    )
    assert code == 2
    assert "jobs.0.deliver_to: the session 'ops' is shared by telegram:-100, slack:C7" in err
    assert "deliver_binding" in err
    assert ok == 0, ok_err
    shown = json.loads(out)
    assert shown["deliver_binding"] == "slack:C7"
    # A job of the file keeps "job:<id>" (see config/jobs.py).
    assert shown["session"] == "job:nightly"
