"""The chaos run: a daemon on three platforms, killed and restarted while it works."""
