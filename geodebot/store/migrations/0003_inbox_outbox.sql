-- Chat delivery: the inbox of accepted platform events, the outbox of replies, and cursors.

-- An event is a row here before the platform is acknowledged; the unique (platform, event_id)
-- is what turns a platform's redelivery into a no-op. No reference to sessions: the event must
-- be committed even before its session exists. "user" is reserved in PostgreSQL, hence user_id.
CREATE TABLE inbox (
    id INTEGER PRIMARY KEY,
    platform TEXT NOT NULL,
    event_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    channel TEXT NOT NULL,
    thread TEXT,
    user_id TEXT NOT NULL,
    text TEXT NOT NULL,
    message_id TEXT NOT NULL,
    received_at DOUBLE PRECISION NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'running', 'done', 'failed', 'dropped')),
    attempts INTEGER NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '',
    finished_at DOUBLE PRECISION,
    UNIQUE (platform, event_id)
);

-- A restart reads the unfinished rows in arrival order.
CREATE INDEX inbox_by_status ON inbox (status, id);

-- A reply is a row here before its first part is sent. inbox_id is unique so an inbox row can
-- never get two replies; rows without one (jobs, notices) are NULL, which UNIQUE allows many
-- of on SQLite and PostgreSQL alike. sent_parts is a JSON object {"index": "message id"}.
CREATE TABLE outbox (
    id INTEGER PRIMARY KEY,
    inbox_id INTEGER UNIQUE REFERENCES inbox (id),
    session_id TEXT NOT NULL,
    platform TEXT NOT NULL,
    channel TEXT NOT NULL,
    thread TEXT,
    reply_to TEXT,
    text TEXT NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'sent', 'failed')),
    sent_parts TEXT NOT NULL DEFAULT '{}',
    in_flight INTEGER,
    attempts INTEGER NOT NULL DEFAULT 0,
    blind_resends INTEGER NOT NULL DEFAULT 0,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    error TEXT NOT NULL DEFAULT ''
);

-- Each platform's sender reads its pending rows in id order.
CREATE INDEX outbox_by_status ON outbox (status, platform, id);

CREATE TABLE cursors (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);
