-- A message a standing-by replica received (Slack spreads its events over every replica's
-- connection) is committed by it and left for the serving replica to take up: ``pickup``
-- names the replica that received it. NULL for every row the serving replica wrote itself.
ALTER TABLE inbox ADD COLUMN pickup TEXT;
CREATE INDEX inbox_pickup ON inbox (id) WHERE pickup IS NOT NULL AND status = 'pending';
