"""The operator's Work console: server-rendered pages on the health server's app
(server.py), assembled from the daemon's own objects (parts.py) and the store; it keeps
nothing of its own. ``live.py`` feeds open pages server-sent events.

Nothing is imported here: the daemon imports ``live`` and ``server`` only when its HTTP
endpoint is on.
"""
