-- Leases: one holder at a time for a named piece of work (the daemon's, when several
-- replicas share a database). ``epoch`` grows at every change of holder; a holder's writes
-- check it (fencing), so a replica that lost its lease while paused commits nothing.
-- ``expires_at`` and ``acquired_at`` are the database's clock, never a replica's.
CREATE TABLE leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    acquired_at DOUBLE PRECISION NOT NULL
);
