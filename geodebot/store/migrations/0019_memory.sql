-- Project memory (store/memory.py): what the agent saved, per project, with where it came
-- from. ``ref`` is the id the tools, the CLI and an export name ('m-' and 16 hex digits, so
-- an import into another store keeps it). ``origin``: chat (a person's own message), relay
-- (a turn answering a relayed ask), job (a scheduled run), terminal, import. ``forwarded``:
-- the turn's message came through Thread Relay. Items are never edited: a correction is a
-- forget and a save.
--
-- memory_projects: each project's slot and its number of items. An item's ``id`` is its
-- project's slot * 2^32 plus its place in the project, so a project's items are one range of
-- ids, which a search reads from the index without the other projects' entries.
CREATE TABLE memory_projects (
    id INTEGER PRIMARY KEY,
    project TEXT NOT NULL UNIQUE,
    items INTEGER NOT NULL DEFAULT 0
);
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
    text, tags, content='memory_items', content_rowid='id'
);
CREATE TRIGGER memory_fts_add AFTER INSERT ON memory_items BEGIN
    INSERT INTO memory_fts (rowid, text, tags) VALUES (new.id, new.text, new.tags);
END;
CREATE TRIGGER memory_fts_remove AFTER DELETE ON memory_items BEGIN
    INSERT INTO memory_fts (memory_fts, rowid, text, tags)
    VALUES ('delete', old.id, old.text, old.tags);
END;
-- backend: postgres
ALTER TABLE memory_items ADD COLUMN search tsvector
    GENERATED ALWAYS AS (to_tsvector('simple', text || ' ' || tags)) STORED;
CREATE INDEX memory_search ON memory_items USING GIN (search);
-- backend: all
