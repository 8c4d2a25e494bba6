"""The one composition root: ``build.py`` builds every shared object once, ``daemon.py``
runs ``geodebot serve`` on them.
"""

from geodebot.app.build import (
    App,
    build_app,
)

__all__ = [
    "App",
    "build_app",
]
