"""Thread Relay: a session reads and sends into other threads of its project, under four
versioned contracts (contracts.py) and their rules."""
