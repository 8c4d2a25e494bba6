-- Dead letters (chat/deadletters.py says which rows count).
--
-- inbox.no_reply: the row was finished 'done' or 'failed' without a reply row, other than a
-- relayed "notify" message (recorded, answered by nobody). The finish writes it in the same
-- commit, so listing such messages reads the few marked rows through the partial index below
-- instead of looking for a reply of every message ever answered. Rows of an older database
-- are marked here once.
ALTER TABLE inbox ADD COLUMN no_reply INTEGER NOT NULL DEFAULT 0;
UPDATE inbox SET no_reply = 1
WHERE status IN ('done', 'failed')
    AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.inbox_id = inbox.id)
    AND (status <> 'done' OR COALESCE(relay_intent, '') <> 'notify');
CREATE INDEX inbox_no_reply ON inbox (id) WHERE no_reply = 1;

-- An operator's decision on a dead letter: kind 'inbox' (a message that will never get a
-- reply) or 'outbox' (a reply the sender gave up on). One decision per row, ever: UNIQUE
-- (kind, row_id) makes the first one win, and it is written in the same transaction that
-- resets a replayed row to 'pending', so a row is replayed (or discarded) at most once.
-- detail keeps the error or detail the row had when decided, since a replay clears it. The
-- id only grows: a running daemon polls its highest value to pick up replays made with the
-- CLI.
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
