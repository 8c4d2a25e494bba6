"""geodebot: a self-hosted chat-ops agent daemon."""

__version__ = "0.1.0"
