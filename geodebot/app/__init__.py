"""The one composition root: ``build.py`` builds every shared object once, ``daemon.py``
runs ``geodebot serve`` on them, ``store.py`` opens the configured store.

Nothing is imported here: a command that only opens the store (``geodebot jobs list``) does
not load the engine and the platforms' SDKs that ``build.py`` brings.
"""
