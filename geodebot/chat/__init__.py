"""A chat message from adapter to reply, platform-free: gate, throttle, inbox router, queues,
commands, replies, outbox and the session <-> binding index."""
