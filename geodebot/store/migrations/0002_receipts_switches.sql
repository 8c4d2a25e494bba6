-- Effect receipts and operator switches.

-- One row per effectful tool call, written before the call is dispatched. "key" is the
-- caller's idempotency key; its uniqueness is what makes a second admission of the same call
-- impossible, across tasks and processes. A resolution only ever reconciles an uncertain one.
CREATE TABLE effect_receipts (
    id TEXT PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    session_id TEXT NOT NULL REFERENCES sessions (id),
    turn_id TEXT NOT NULL,
    call_id TEXT NOT NULL,
    tool TEXT NOT NULL,
    effect TEXT NOT NULL,
    arguments_sha256 TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('admitted', 'committed', 'failed', 'uncertain')),
    admitted_at DOUBLE PRECISION NOT NULL,
    finished_at DOUBLE PRECISION,
    outcome TEXT NOT NULL DEFAULT '{}',
    resolution TEXT CHECK (resolution IN ('done', 'failed')),
    resolved_by TEXT,
    resolved_at DOUBLE PRECISION,
    CHECK (resolution IS NULL OR status = 'uncertain')
);

-- The startup sweep and the operator's queue both select by status; listings are in
-- admission order, so the order columns follow the filter columns.
CREATE INDEX effect_receipts_by_status ON effect_receipts (status, admitted_at, id);

CREATE INDEX effect_receipts_by_session ON effect_receipts (session_id, status, admitted_at, id);

-- enabled is 0/1: INTEGER reads the same on SQLite and PostgreSQL.
CREATE TABLE operator_switches (
    name TEXT PRIMARY KEY,
    enabled INTEGER NOT NULL CHECK (enabled IN (0, 1)),
    set_by TEXT NOT NULL,
    set_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION,
    reason TEXT NOT NULL DEFAULT ''
);

-- Append-only; id orders it, since two settings may share a timestamp.
CREATE TABLE operator_switch_history (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL REFERENCES operator_switches (name),
    enabled INTEGER NOT NULL CHECK (enabled IN (0, 1)),
    set_by TEXT NOT NULL,
    set_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION,
    reason TEXT NOT NULL DEFAULT ''
);

CREATE INDEX operator_switch_history_by_name ON operator_switch_history (name, id);
