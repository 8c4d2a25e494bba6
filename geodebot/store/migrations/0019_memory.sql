-- Project memory (store/memory.py): what the agent saved, per project, with where it came
-- from. ``ref`` is the id the tools, the CLI and an export name ('m-' and 16 hex digits,
-- random, so an import into another store keeps it); ``id`` orders the rows and keys the
-- search index. ``origin``: chat (a person's own message), relay (a turn answering a
-- relayed ask), job (a scheduled run), terminal, import. ``forwarded``: the turn's message
-- came through Thread Relay. Items are never edited: a correction is a forget and a save.
CREATE TABLE memory_items (
    id INTEGER PRIMARY KEY,
    ref TEXT NOT NULL UNIQUE,
    project TEXT NOT NULL,
    text TEXT NOT NULL,
    tags TEXT NOT NULL DEFAULT '',
    session_id TEXT NOT NULL DEFAULT '',
    turn_id TEXT NOT NULL DEFAULT '',
    user_id TEXT NOT NULL DEFAULT '',
    origin TEXT NOT NULL,
    forwarded INTEGER NOT NULL DEFAULT 0,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX memory_by_project ON memory_items (project, id);

-- The search index, each store its own: SQLite FTS5 (bm25), PostgreSQL a tsvector with a
-- GIN index (ts_rank), both splitting words as 'simple' does (lower case, no stemming).
-- backend: sqlite
CREATE VIRTUAL TABLE memory_fts USING fts5(
    project, text, tags, content='memory_items', content_rowid='id'
);
CREATE TRIGGER memory_fts_add AFTER INSERT ON memory_items BEGIN
    INSERT INTO memory_fts (rowid, project, text, tags)
    VALUES (new.id, new.project, new.text, new.tags);
END;
CREATE TRIGGER memory_fts_remove AFTER DELETE ON memory_items BEGIN
    INSERT INTO memory_fts (memory_fts, rowid, project, text, tags)
    VALUES ('delete', old.id, old.project, old.text, old.tags);
END;
-- backend: postgres
ALTER TABLE memory_items ADD COLUMN search tsvector
    GENERATED ALWAYS AS (to_tsvector('simple', text || ' ' || tags)) STORED;
CREATE INDEX memory_search ON memory_items USING GIN (search);
-- backend: all
