"""The channel factory's lean SDK imports."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from geodebot.channels.factory import _without


def test_without_hides_a_module_inside_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "geodebot_probe_extra.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "geodebot_probe_extra", raising=False)
    with _without(("geodebot_probe_extra",)), pytest.raises(ImportError):
        importlib.import_module("geodebot_probe_extra")
    assert "geodebot_probe_extra" not in sys.modules  # the marker is gone again
    module = importlib.import_module("geodebot_probe_extra")
    assert module.VALUE == 1
    # One already imported stays usable inside.
    with _without(("geodebot_probe_extra",)):
        assert importlib.import_module("geodebot_probe_extra") is module
    assert sys.modules["geodebot_probe_extra"] is module


def test_without_hides_submodules_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    package = tmp_path / "geodebot_probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "inner.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with _without(("geodebot_probe_pkg",)), pytest.raises(ImportError):
        importlib.import_module("geodebot_probe_pkg.inner")
    assert importlib.import_module("geodebot_probe_pkg.inner").VALUE == 2
