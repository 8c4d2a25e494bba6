"""Replicas sharing a PostgreSQL store: the daemon's lease (daemon_lease.py), one lease per
session (leases.py), the session owner over them (owner.py), the take-up of a session held
at a new epoch (takeup.py) and the look for sessions with work nobody does (pickup.py).

Above chat/ and scheduler/: they know only the owner's seam (chat/ownership.py).
"""
