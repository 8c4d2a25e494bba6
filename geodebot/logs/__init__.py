"""Logging: setup, per-task context, and redaction of secrets."""
