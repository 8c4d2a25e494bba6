-- Approval requests: a tool call that needs a person's yes, asked in the chat (or the
-- console) and decided once. The id is the unguessable token a card's buttons carry; a press
-- names it, and only a pending, unexpired row can be decided, so a second press, a late one or
-- a replayed one changes nothing. (session_id, turn_id, call_id) is unique: a turn resumed
-- after a restart finds its request instead of asking again.
CREATE TABLE approval_requests (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions (id),
    turn_id TEXT NOT NULL,
    call_id TEXT NOT NULL,
    tool TEXT NOT NULL,
    safety TEXT NOT NULL,
    -- sha256 of the plan digest, the tool and its canonical arguments: a decision holds for
    -- exactly that call, and a rewritten call needs a request of its own.
    call_sha256 TEXT NOT NULL,
    -- The arguments as the card shows them: redacted and shortened.
    summary TEXT NOT NULL,
    -- The binding (platform:channel) whose approvers may decide, and their user ids (JSON).
    origin TEXT NOT NULL,
    approvers TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'approved', 'denied', 'expired')),
    created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    decided_by TEXT,
    decided_via TEXT,
    decided_at DOUBLE PRECISION,
    -- Where the card was posted (platform, channel, message id), to edit it with the outcome.
    card TEXT NOT NULL DEFAULT '{}',
    UNIQUE (session_id, turn_id, call_id),
    CHECK ((status = 'pending') = (decided_at IS NULL))
);

-- The expiry sweep and the pending listings select by status, oldest first.
CREATE INDEX approval_requests_by_status ON approval_requests (status, expires_at, id);
