-- Scheduled jobs created at run time (chat, CLI), the config's jobs mirrored for pause state,
-- and the history of every fire.

-- Times that define fires are whole milliseconds since the epoch (INTEGER), so one fire
-- computed by two processes is the same key. since_ms: fires at or before it are not owed
-- (set at creation, resume and schedule change), which bounds catch-up after downtime.
CREATE TABLE scheduled_jobs (
    id TEXT PRIMARY KEY,
    origin TEXT NOT NULL CHECK (origin IN ('config', 'chat', 'cli')),
    schedule_kind TEXT NOT NULL CHECK (schedule_kind IN ('cron', 'every', 'at')),
    schedule TEXT NOT NULL,
    timezone TEXT NOT NULL,
    anchor_ms INTEGER NOT NULL,
    prompt TEXT NOT NULL,
    deliver_to TEXT NOT NULL,
    session_id TEXT NOT NULL,
    tools TEXT NOT NULL,
    time_budget_s DOUBLE PRECISION,
    catch_up TEXT NOT NULL CHECK (catch_up IN ('latest', 'skip', 'all')),
    notify_on_failure INTEGER NOT NULL CHECK (notify_on_failure IN (0, 1)),
    creator TEXT NOT NULL DEFAULT '',
    paused INTEGER NOT NULL DEFAULT 0 CHECK (paused IN (0, 1)),
    since_ms INTEGER NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);

-- One row per fire: the claim and the history entry are the same row. UNIQUE (job_id,
-- scheduled_ms) is what makes a second claim of the same fire impossible, across tasks,
-- restarts and processes. No reference to scheduled_jobs: history outlives a removed job.
-- notice: the failure notice's delivery, when one was posted.
CREATE TABLE job_fires (
    id INTEGER PRIMARY KEY,
    job_id TEXT NOT NULL,
    scheduled_ms INTEGER NOT NULL,
    cause TEXT NOT NULL CHECK (cause IN ('schedule', 'catch-up', 'manual')),
    outcome TEXT NOT NULL CHECK (outcome IN ('requested', 'running', 'delivering', 'ok',
        'failed', 'budget', 'skipped-overlap', 'skipped-missed', 'delivery-failed')),
    reason TEXT NOT NULL DEFAULT '',
    claimed_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION,
    ended_at DOUBLE PRECISION,
    outbox_id INTEGER REFERENCES outbox (id),
    notice TEXT NOT NULL DEFAULT '' CHECK (notice IN ('', 'pending', 'delivered',
        'delivery-failed')),
    UNIQUE (job_id, scheduled_ms)
);

-- History and "last fire" per job read newest first.
CREATE INDEX job_fires_by_job ON job_fires (job_id, id);

-- The overlap check, the restart sweep and delivery settling select by outcome, and the
-- settling of failure notices by notice, so neither reads the whole history once a second.
CREATE INDEX job_fires_by_outcome ON job_fires (outcome, job_id);

CREATE INDEX job_fires_by_notice ON job_fires (notice);
