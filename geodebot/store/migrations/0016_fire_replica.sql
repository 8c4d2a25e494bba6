-- With replicas every one of them runs the scheduler and the fire claims decide who runs each
-- fire: ``replica`` names the replica that claimed a fire (started it), so that a replica's
-- start fails only its own fires cut short, and a fire whose replica went silent is failed by
-- the others. Empty for rows that never ran, and for rows written before this.
ALTER TABLE job_fires ADD COLUMN replica TEXT NOT NULL DEFAULT '';
