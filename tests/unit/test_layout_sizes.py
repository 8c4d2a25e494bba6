"""The platform adapters stay small: a file under channels/ holds one role of one platform
(taking in, sending, cards, files), and a class composes roles instead of growing them."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "geodebot"
CHANNELS = PACKAGE / "channels"
MAX_LINES = 450
MAX_METHODS = 30


def file_lines(root: Path) -> dict[str, int]:
    return {
        str(path.relative_to(root)): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(root.rglob("*.py"))
    }


def class_methods(root: Path) -> dict[str, int]:
    """Per class (``file:Class``), the functions defined in its body: methods, properties
    and dunders alike."""
    counts = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                defs = (ast.FunctionDef, ast.AsyncFunctionDef)
                counts[f"{path.relative_to(root)}:{node.name}"] = sum(
                    isinstance(item, defs) for item in node.body
                )
    return counts


def test_no_channel_file_passes_the_line_limit() -> None:
    lines = file_lines(CHANNELS)
    assert lines, "no modules under channels/"
    assert {name: n for name, n in lines.items() if n > MAX_LINES} == {}


def test_no_channel_class_passes_the_method_limit() -> None:
    methods = class_methods(CHANNELS)
    assert methods, "no classes under channels/"
    assert {name: n for name, n in methods.items() if n > MAX_METHODS} == {}


def test_the_counts_see_what_they_count(tmp_path: Path) -> None:
    body = "".join(f"    def m{i}(self): ...\n" for i in range(3))
    source = f"class A:\n{body}    @property\n    def p(self): ...\n    async def a(self): ...\n"
    (tmp_path / "a.py").write_text(source + "\n" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("class B:\n    class Inner:\n        def x(self): ...\n")
    assert class_methods(tmp_path) == {"a.py:A": 5, "sub/b.py:B": 0, "sub/b.py:Inner": 1}
    assert file_lines(tmp_path) == {"a.py": 17, "sub/b.py": 3}
