-- Files in and out. inbox.files: what the platform said a message carried (JSON list of
-- {ref, name, media_type, size}), committed with the message before the platform is
-- acknowledged. inbox.attached: what became of them once checked (JSON list; NULL until then),
-- so a turn resumed after a crash neither downloads again nor repeats its refusal notice.
-- outbox.file: a file the message uploads ({sha256, name, media_type, size} in the file store;
-- '' for a text message).
ALTER TABLE inbox ADD COLUMN files TEXT NOT NULL DEFAULT '[]';
ALTER TABLE inbox ADD COLUMN attached TEXT;
ALTER TABLE outbox ADD COLUMN file TEXT NOT NULL DEFAULT '';
