"""Scheduled jobs: triggers that start DAEMON sessions."""
