-- Initial schema. Types stay plain (TEXT, INTEGER, DOUBLE PRECISION) so the same DDL reads
-- naturally on PostgreSQL; JSON payloads are TEXT written by the store.

-- next_seq lives on the session row so that appending a message never has to look at the
-- message history to find the next sequence number.
CREATE TABLE sessions (
    id TEXT PRIMARY KEY,
    mode TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    generation INTEGER NOT NULL DEFAULT 1,
    state TEXT NOT NULL DEFAULT '{}',
    guards TEXT NOT NULL DEFAULT '{}',
    next_seq INTEGER NOT NULL DEFAULT 1
);

CREATE INDEX sessions_by_updated ON sessions (updated_at);

CREATE TABLE messages (
    session_id TEXT NOT NULL REFERENCES sessions (id),
    seq INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    role TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('message', 'summary')),
    content TEXT NOT NULL,
    turn_id TEXT NOT NULL,
    covers_from INTEGER,
    covers_to INTEGER,
    created_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (session_id, seq)
);

-- Serves both context reads: "newest summary of this generation" is one seek from the end of
-- the (session, generation, 'summary') range, and the messages after it are one range scan,
-- so neither read touches older generations or the rest of the history.
CREATE INDEX messages_by_kind ON messages (session_id, generation, kind, seq);

CREATE TABLE tool_batches (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions (id),
    generation INTEGER NOT NULL,
    turn_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('proposed', 'done', 'abandoned')),
    calls TEXT NOT NULL,
    results TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    finished_at DOUBLE PRECISION
);

CREATE INDEX tool_batches_by_status ON tool_batches (session_id, status);

CREATE TABLE timeline (
    id INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions (id),
    turn_id TEXT,
    ts DOUBLE PRECISION NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL
);

CREATE INDEX timeline_by_session ON timeline (session_id, id);
