"""The fault suite: each fault has a test of what the user sees, that the daemon answers the
next message, and that nothing acknowledged is lost or answered twice."""
