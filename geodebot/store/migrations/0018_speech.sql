-- Spoken answers (chat/voice.py): a reply row may carry speech, sent as one more part after
-- its text parts. ``speech``: the JSON of what is to be spoken ({"text", "cut"}), '' for
-- none; ``spoken``: the JSON of the stored audio (store/files.py) once it was made, so a
-- send tried again after a crash or a platform error uploads the same audio and never asks
-- the speech service twice.
ALTER TABLE outbox ADD COLUMN speech TEXT NOT NULL DEFAULT '';
ALTER TABLE outbox ADD COLUMN spoken TEXT NOT NULL DEFAULT '';
