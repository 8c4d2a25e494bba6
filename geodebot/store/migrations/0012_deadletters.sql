-- Dead letters: an operator's decision on an accepted message that will never get a reply
-- (kind 'inbox') or a reply the sender gave up on (kind 'outbox'); chat/deadletters.py says
-- which rows count. One decision per row, ever: UNIQUE (kind, row_id) makes the first one
-- win, and it is written in the same transaction that resets a replayed row to 'pending', so
-- a row is replayed (or discarded) at most once. detail keeps the error or detail the row
-- had when decided, since a replay clears it. The id only grows: a running daemon polls its
-- highest value to pick up replays made with the CLI.
CREATE TABLE deadletter_decisions (
    id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL CHECK (kind IN ('inbox', 'outbox')),
    row_id INTEGER NOT NULL,
    action TEXT NOT NULL CHECK (action IN ('replay', 'discard')),
    decided_by TEXT NOT NULL,
    via TEXT NOT NULL CHECK (via IN ('cli', 'console')),
    decided_at DOUBLE PRECISION NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    UNIQUE (kind, row_id)
);
