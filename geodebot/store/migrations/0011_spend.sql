-- Token and spend budgets. model_calls: one row per model call, written before the call
-- when a budget applies (state 'reserved', holding the call's worst case) or after it
-- otherwise, and settled with what the provider reported ('settled'; 'failed' for a call
-- that got no answer). A row a crash left 'reserved' keeps its worst case counted: a crash
-- never frees budget that may have been spent. charges: the counters the row is counted in,
-- as JSON [[scope, period, unit], ...], so settling adjusts exactly those.
CREATE TABLE model_calls (
    id TEXT PRIMARY KEY,
    day TEXT NOT NULL,
    created_at REAL NOT NULL,
    settled_at REAL,
    session_id TEXT NOT NULL,
    turn_id TEXT,
    binding TEXT,
    job TEXT,
    run TEXT,
    provider TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    state TEXT NOT NULL,
    reserved_tokens INTEGER NOT NULL DEFAULT 0,
    reserved_usd REAL NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    cache_read_tokens INTEGER NOT NULL DEFAULT 0,
    cache_write_tokens INTEGER NOT NULL DEFAULT 0,
    cost_usd REAL,
    charges TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX model_calls_by_day ON model_calls (day, created_at);

-- What each budget has used in a period: the sum, over the model calls charged to it, of
-- what they used once settled and of their worst case while reserved. scope: 'daemon',
-- 'binding:<platform>:<channel>', 'job:<id>' (period: the run), 'usd'; period: the UTC day
-- ('2026-12-03') or the run's id.
CREATE TABLE spend_counters (
    scope TEXT NOT NULL,
    period TEXT NOT NULL,
    used REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, period)
);
