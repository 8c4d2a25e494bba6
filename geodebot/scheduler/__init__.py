"""Scheduled jobs: triggers, fire claims, runs as DAEMON sessions, delivery and history.

APScheduler (in-memory job store) only computes when a job is due; whether a fire runs is
decided by a claim row in our store, unique per (job, scheduled time), so neither a restart
nor a second process can run one fire twice.
"""
