"""The redactor every process starts with: each secret the configuration names, as this
process can read it (environment or systemd credential), masked in whatever it logs.

Apart from build.py so that a command that only reads the store gets it without loading
the engine.
"""

from __future__ import annotations

from geodebot.config.schema import Config, resolve_secret, secret_names
from geodebot.logs.redact import Redactor

__all__ = ["build_redactor"]


def build_redactor(config: Config) -> Redactor:
    redactor = Redactor()
    for name in secret_names(config):
        redactor.add(resolve_secret(name))
    return redactor
