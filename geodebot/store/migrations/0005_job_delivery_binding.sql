-- The binding a job posts in, by key (platform:channel): several bindings may share one
-- session, so deliver_to (a session id) does not name one chat. '' in the rows written
-- before: they post in the one binding whose session deliver_to is, and fail when several
-- bindings share it, until a daemon start names the binding of those that have one.
ALTER TABLE scheduled_jobs ADD COLUMN deliver_binding TEXT NOT NULL DEFAULT '';
