-- DM pairing and the bindings made at run time (store/pairing.py, chat/pairing.py).

-- A stranger's request to talk to the bot: who, where, when, and the first 200 characters
-- of what they wrote, nothing more. ``code`` is the one-time code they were given; only a
-- pending row can be approved or denied, once, before ``expires_at``. ``event_id`` is the
-- message that asked (its redelivery asks nothing again); ``noticed_at``, when they were last
-- told that their request waits (at most once a minute).
CREATE TABLE pairings (
    id INTEGER PRIMARY KEY,
    platform TEXT NOT NULL,
    code TEXT NOT NULL,
    user_id TEXT NOT NULL,
    user_name TEXT NOT NULL DEFAULT '',
    channel TEXT NOT NULL,
    thread TEXT,
    is_dm INTEGER NOT NULL,
    first_text TEXT NOT NULL,
    event_id TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    noticed_at DOUBLE PRECISION NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'approved', 'denied', 'expired')),
    decided_at DOUBLE PRECISION,
    decided_by TEXT NOT NULL DEFAULT '',
    binding_key TEXT NOT NULL DEFAULT '',
    UNIQUE (platform, code)
);

-- The pending requests of a platform, and a user's own, are looked up on every stranger's
-- message.
CREATE INDEX pairings_pending ON pairings (platform, status, user_id);

-- Bindings made at run time (an approved pairing, say), beside the config file's: ``data`` is
-- the binding's table as JSON, validated as a config binding is when read. The config's own
-- binding for the same key wins, and this one is then reported as shadowed.
CREATE TABLE stored_bindings (
    binding_key TEXT PRIMARY KEY,
    platform TEXT NOT NULL,
    channel TEXT NOT NULL,
    data TEXT NOT NULL,
    origin TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    created_by TEXT NOT NULL
);

-- One counter that every change of stored_bindings raises in its own transaction: a daemon
-- reads it (one row) to know whether to read the bindings again.
INSERT INTO cursors (name, value, updated_at) VALUES ('stored_bindings', '0', 0);
