-- A streamed answer's preview: the platform message that is edited as the answer arrives. The
-- inbox row keeps its id from the first preview on, so a turn resumed after a crash edits the
-- same message; the reply's outbox row carries it too, so the final answer replaces the preview
-- instead of arriving as a second message.
ALTER TABLE inbox ADD COLUMN preview TEXT NOT NULL DEFAULT '';
ALTER TABLE outbox ADD COLUMN preview TEXT NOT NULL DEFAULT '';
