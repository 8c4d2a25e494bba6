-- Voice (chat/voice.py). A reply row may carry speech, sent as one more part after its
-- text parts. ``speech``: the JSON of what is to be spoken ({"text", "cut"}), '' for
-- none; ``spoken``: the JSON of the stored audio (store/files.py) once it was made, so a
-- send tried again after a crash or a platform error uploads the same audio and never asks
-- the speech service twice.
ALTER TABLE outbox ADD COLUMN speech TEXT NOT NULL DEFAULT '';
ALTER TABLE outbox ADD COLUMN spoken TEXT NOT NULL DEFAULT '';

-- Audio services' calls are model calls of provider 'audio' (engine/spend.py): the seconds
-- transcribed and the characters spoken, for `geodebot usage` and their cost for the budgets.
ALTER TABLE model_calls ADD COLUMN audio_seconds DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE model_calls ADD COLUMN spoken_chars INTEGER NOT NULL DEFAULT 0;
