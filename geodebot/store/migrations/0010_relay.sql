-- Thread Relay. relay_deliveries: one row per delivery attempt, holding its receipt
-- (ThreadDeliveryReceiptV1 as JSON: a checksum of the text, never the text) and, for one
-- that got that far, its envelope without the text (ThreadMessageEnvelopeV1). A delivered
-- row has its idempotency key, unique per source session, so a repeated key finds the first
-- receipt; a refused attempt has none (NULLs are distinct), so it can be tried again once
-- its cause is gone. inbox_id and outbox_id are what the delivery wrote into the target: the
-- message its session records (and, for an ask, answers) and the attributed post.
CREATE TABLE relay_deliveries (
    id TEXT PRIMARY KEY,
    source_session TEXT NOT NULL,
    target_session TEXT NOT NULL,
    project TEXT NOT NULL,
    user_id TEXT NOT NULL,
    source_turn TEXT NOT NULL,
    idem_key TEXT,
    intent TEXT NOT NULL,
    mode TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    content_sha256 TEXT NOT NULL,
    receipt TEXT NOT NULL,
    envelope TEXT NOT NULL DEFAULT '{}',
    inbox_id INTEGER,
    outbox_id INTEGER,
    created_at REAL NOT NULL,
    UNIQUE (source_session, idem_key)
);
CREATE INDEX relay_by_source ON relay_deliveries (source_session, created_at);
CREATE INDEX relay_by_target ON relay_deliveries (target_session, created_at);
CREATE INDEX relay_by_time ON relay_deliveries (created_at, id);

-- What a session last read of another thread: a send is checked against it (revision,
-- active turn, capability revision, adapter) and expires with it.
CREATE TABLE relay_reads (
    source_session TEXT NOT NULL,
    target_session TEXT NOT NULL,
    revision INTEGER NOT NULL,
    capability TEXT NOT NULL,
    active_turn TEXT,
    adapter TEXT NOT NULL,
    read_at REAL NOT NULL,
    PRIMARY KEY (source_session, target_session)
);

-- A relayed message in its target's inbox: the delivery it came with and its intent
-- (notify: recorded in the session; ask: also answered there). NULL for platform events.
ALTER TABLE inbox ADD COLUMN relay_id TEXT;
ALTER TABLE inbox ADD COLUMN relay_intent TEXT;
-- Finding the messages a user wrote in a session (a user_authored send is checked against
-- them) and a session's running turn without reading the whole inbox.
CREATE INDEX inbox_by_session ON inbox (session_id, id);
