-- The replicas that share this database, as each one last said it was there: status pages
-- list a replica's peers from here. ``seen_at`` and ``started_at`` are the database's clock.
-- A replica removes its row when it stops; a killed one's row ages and is pruned.
CREATE TABLE replicas (
    replica_id TEXT PRIMARY KEY,
    role TEXT NOT NULL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started_at DOUBLE PRECISION NOT NULL,
    seen_at DOUBLE PRECISION NOT NULL
);
