"""The layout's contract, checked on the source: imports point down the layers, never up or
round in a cycle, between packages or between the modules of one package; only channels/
imports a platform SDK; only engine/llm imports model SDKs.

Layers, top to bottom (see the README's "Architecture"): cli -> app -> replicas -> ops, chat,
scheduler, desktop, testing -> channels -> engine -> store, config, logs. A package may import
its own modules, the packages below it, and a package of its own layer when that makes no
cycle; the bottom layer imports nothing of geodebot but itself.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "geodebot"
PLATFORM_SDKS = {"slack_bolt", "slack_sdk", "discord", "telegram"}
MODEL_SDKS = {"anthropic", "openai"}
LAYERS: dict[str, int] = {
    "__main__": 8,
    "cli": 7,
    "app": 6,
    "replicas": 5,
    "ops": 4,
    "chat": 4,
    "scheduler": 4,
    "relay": 4,
    "memory": 4,
    "desktop": 4,
    "testing": 4,
    "channels": 3,
    "engine": 2,
    "store": 1,
    "config": 1,
    "logs": 1,
}
# Modules at the top of the package: the version, `python -m geodebot`, public test fakes.
TOP_LEVEL = {"__init__", "__main__", "testing"}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path = PACKAGE) -> Iterator[str]:
    """Every module ``path`` imports, absolute, in any form: ``import a.b``, ``from a import
    b`` (``b`` may itself be a module), relative imports, and nested or conditional ones."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def layer_of(module: str) -> str | None:
    """The top package of a geodebot module (``geodebot.chat.router`` -> ``chat``); None for
    the package root itself and for anything outside geodebot."""
    parts = module.split(".")
    if parts[0] != "geodebot" or len(parts) < 2:
        return None
    return parts[1]


def package_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Which top packages each top package imports (an import of a name that is not a
    module, like ``geodebot.config.Config``, counts for its package all the same)."""
    graph: dict[str, set[str]] = {}
    # ``from geodebot import __version__`` names a value of the root package, not a package.
    tops = {path.stem for path in root.glob("*.py")} | {
        p.name for p in root.iterdir() if p.is_dir()
    }
    for path in sorted(root.rglob("*.py")):
        source = layer_of(module_name(path, root))
        if source is None:
            continue
        targets = graph.setdefault(source, set())
        for target in map(layer_of, imports(path, root)):
            if target is not None and target != source and target in tops:
                targets.add(target)
    return graph


def upward(graph: Mapping[str, set[str]]) -> list[str]:
    problems = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            if target not in LAYERS or source not in LAYERS:
                problems.append(f"{source} -> {target}: a package with no layer")
            elif LAYERS[target] > LAYERS[source] or (LAYERS[source] == 1 and target != source):
                problems.append(f"{source} -> {target}")
    return problems


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def sdk_roots(path: Path) -> set[str]:
    return {module.split(".")[0] for module in imports(path)}


def modules(subpackage: str) -> list[Path]:
    found = sorted((PACKAGE / subpackage).rglob("*.py"))
    assert found, f"no modules under {subpackage}"
    return found


def test_imports_point_down_the_layers() -> None:
    assert upward(package_graph()) == []


def test_no_import_cycle_between_packages() -> None:
    assert cycles(package_graph()) == []


# Spelled out per package, so a change of LAYERS cannot quietly allow these.
FORBIDDEN: dict[str, set[str]] = {
    "__main__": set(),
    "cli": {"__main__"},
    "app": {"cli", "__main__"},
    "replicas": {"app", "cli"},
    "ops": {"replicas", "app", "cli"},
    "chat": {"replicas", "app", "cli", "ops"},
    "scheduler": {"replicas", "app", "cli", "ops"},
    "relay": {"replicas", "app", "cli", "ops"},
    "memory": {"replicas", "app", "cli", "ops"},
    "desktop": {"replicas", "app", "cli", "chat", "scheduler", "relay", "memory", "ops"},
    "testing": {"replicas", "app", "cli"},
    "channels": {"chat", "scheduler", "relay", "memory", "ops", "replicas", "app", "cli"},
    "engine": {
        *("channels", "chat", "scheduler", "relay", "memory", "ops", "replicas", "app", "cli")
    },
    "store": set(LAYERS) - {"store"},
    "config": set(LAYERS) - {"config"},
    "logs": set(LAYERS) - {"logs"},
}
# The packages that may import a platform SDK: the adapters, and the composition root's
# callers only through them.
SDK_PACKAGES = {"channels"}


@pytest.mark.parametrize(("source", "forbidden"), sorted(FORBIDDEN.items()))
def test_the_edges_never_import_what_is_above_them(source: str, forbidden: set[str]) -> None:
    assert package_graph().get(source, set()) & forbidden == set()


def test_every_package_is_in_the_contract() -> None:
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert (packages | {"__main__", "testing"}) == set(LAYERS) == set(FORBIDDEN)


def test_every_stage_lives_in_its_package() -> None:
    loose = {path.stem for path in PACKAGE.glob("*.py")} - TOP_LEVEL
    assert loose == set()
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert packages - set(LAYERS) == set()


@pytest.mark.parametrize(
    "subpackage",
    sorted(
        path.name
        for path in PACKAGE.iterdir()
        if (path / "__init__.py").exists() and path.name not in SDK_PACKAGES
    ),
)
def test_no_platform_sdk_imports(subpackage: str) -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(sdk_roots(path) & PLATFORM_SDKS)
        for path in modules(subpackage)
        if sdk_roots(path) & PLATFORM_SDKS
    }
    assert offenders == {}


def test_the_top_modules_import_no_platform_sdk() -> None:
    offenders = {path.name for path in PACKAGE.glob("*.py") if sdk_roots(path) & PLATFORM_SDKS}
    assert offenders == set()


def module_graph(subpackage: str, root: Path = PACKAGE) -> dict[str, set[str]]:
    """Which modules of ``subpackage`` each of its modules imports (type-only imports
    count: a cycle of them is still two modules that cannot be read apart)."""
    paths = sorted((root / subpackage).rglob("*.py"))
    names = {module_name(path, root) for path in paths}
    return {
        module_name(path, root): {
            target
            for target in imports(path, root)
            if target in names and target != module_name(path, root)
        }
        for path in paths
    }


@pytest.mark.parametrize(
    "subpackage",
    sorted(path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()),
)
def test_no_import_cycle_inside_a_package(subpackage: str) -> None:
    assert cycles(module_graph(subpackage)) == []


def test_model_sdks_only_in_llm_adapters() -> None:
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if sdk_roots(path) & MODEL_SDKS and "llm" not in path.relative_to(PACKAGE).parts
    ]
    assert offenders == []


# -- the checker itself ----------------------------------------------------------------------


def _tree(tmp_path: Path, files: Mapping[str, str]) -> Path:
    root = tmp_path / "geodebot"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for directory in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (directory / "__init__.py").touch()
    return root


def test_the_checker_sees_every_import_form(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "channels/a.py": (
                "import geodebot.app.build\n"
                "from .. import chat\n"
                "from ..scheduler.job_scheduler import JobScheduler\n"
                "from geodebot import cli\n"
                "def f():\n    import telegram.ext as t\n    from discord import Client\n"
            ),
            "chat/b.py": "from . import c\nfrom .c import d\n",
            "app/build.py": "",
            "scheduler/job_scheduler.py": "",
            "cli/main.py": "",
        },
    )
    found = set(imports(root / "channels" / "a.py", root))
    assert {"geodebot.app.build", "geodebot.chat", "geodebot.scheduler.job_scheduler"} <= found
    assert {"geodebot.cli", "telegram.ext", "discord"} <= found
    assert {"geodebot.chat.c", "geodebot.chat.c.d"} <= set(imports(root / "chat" / "b.py", root))
    graph = package_graph(root)
    assert graph["channels"] == {"app", "chat", "scheduler", "cli"}
    assert upward(graph) == [
        "channels -> app",
        "channels -> chat",
        "channels -> cli",
        "channels -> scheduler",
    ]


def test_the_checker_sees_a_cycle_and_a_bottom_package_reaching_sideways(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "chat/a.py": "from geodebot.scheduler import b\n",
            "scheduler/b.py": "from geodebot.chat.a import x\n",
            "store/c.py": "from geodebot.config import schema\n",
            "config/schema.py": "",
        },
    )
    graph = package_graph(root)
    assert cycles(graph) == [["chat", "scheduler", "chat"]]
    assert upward(graph) == ["store -> config"]


def test_the_checker_sees_a_cycle_inside_a_package(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "chat/a.py": "from geodebot.chat.b import x\n",
            "chat/b.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import a\n",
            "chat/c.py": "from geodebot.chat.a import y\n",
        },
    )
    assert cycles(module_graph("chat", root)) == [
        ["geodebot.chat.a", "geodebot.chat.b", "geodebot.chat.a"]
    ]
