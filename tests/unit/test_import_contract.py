"""engine/ and store/ never import a platform SDK; only engine/llm imports model SDKs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "geodebot"
PLATFORM_SDKS = {"slack_bolt", "slack_sdk", "discord", "telegram"}
MODEL_SDKS = {"anthropic", "openai"}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def modules(subpackage: str) -> list[Path]:
    found = sorted((PACKAGE / subpackage).rglob("*.py"))
    assert found, f"no modules under {subpackage}"
    return found


@pytest.mark.parametrize("subpackage", ["engine", "store"])
def test_no_platform_sdk_imports(subpackage: str) -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(imported_roots(path) & PLATFORM_SDKS)
        for path in modules(subpackage)
        if imported_roots(path) & PLATFORM_SDKS
    }
    assert offenders == {}


def test_model_sdks_only_in_llm_adapters() -> None:
    offenders = [
        str(path.relative_to(PACKAGE))
        for sub in ("engine", "store")
        for path in modules(sub)
        if imported_roots(path) & MODEL_SDKS and "llm" not in path.relative_to(PACKAGE).parts
    ]
    assert offenders == []


def test_engine_and_store_do_not_import_the_edges() -> None:
    edges = {"geodebot.channels", "geodebot.scheduler", "geodebot.cli.main", "geodebot.app.build"}
    offenders = []
    for sub in ("engine", "store"):
        for path in modules(sub):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.ImportFrom)
                    and node.module
                    and any(node.module.startswith(edge) for edge in edges)
                ):
                    offenders.append(f"{path.relative_to(PACKAGE)}: {node.module}")
    assert offenders == []


def test_checker_sees_a_platform_import(tmp_path: Path) -> None:
    # Guards the guard: the AST walk must catch nested and aliased imports.
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    import telegram.ext as t\n    from discord import Client\n")
    assert imported_roots(sample) >= {"telegram", "discord"}
