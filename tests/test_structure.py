"""The code's layout, held to what the README promises a newcomer.

- Every import inside the package is relative and names a file that exists
  at the path it names, from the importing file (no install needed to follow it).
- The daemon's parts import only downward: service -> reconcile -> jobs ->
  steps -> loop, and the watcher none of them (upward needs are callbacks).
- One concept per module: no module over ~500 lines, no class over ~300.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "handlers")
LAYERS = ["process", "service", "reconcile", "jobs", "steps", "loop"]  # top to bottom
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 310


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).glob("*.py"))


def imports(path: Path) -> Iterator[tuple[ast.ImportFrom | ast.Import, Path | None]]:
    """Each import of the package's own code with the file it names (None: not ours)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield node, None
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*(node.module or "").split(".")) if node.module else base
            yield node, target


def resolves(target: Path, names: list[str]) -> bool:
    if target.with_suffix(".py").is_file():
        return True
    # `from . import a, b`: each name is a module (our __init__.py files define nothing).
    return target.is_dir() and all(
        (target / f"{name}.py").is_file() or (target / name / "__init__.py").is_file()
        for name in names
    )


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_import_of_our_code_is_relative_and_names_an_existing_file(path: Path) -> None:
    for node, target in imports(path):
        if target is None:
            assert isinstance(node, ast.Import)
            assert not any(a.name.split(".")[0] in ("skilltrain", *PACKAGES) for a in node.names)
            continue
        assert isinstance(node, ast.ImportFrom)
        names = [alias.name for alias in node.names]
        assert resolves(target, names), f"line {node.lineno}: {target} {names} not found"
    source = path.read_text(encoding="utf-8")
    assert "from skilltrain" not in source and "import skilltrain" not in source


def daemon_modules_imported(path: Path) -> set[str]:
    """The daemon/ modules `path` imports: `from .jobs import X`, `from . import jobs`."""
    found = set()
    for node, target in imports(path):
        if target is None or not isinstance(node, ast.ImportFrom):
            continue
        if target == REPO / "daemon":
            found |= {alias.name for alias in node.names}
        elif target.parent == REPO / "daemon":
            found.add(target.name)
    return found


def test_the_daemons_parts_import_only_downward() -> None:
    for i, layer in enumerate(LAYERS):
        above = set(LAYERS[:i])
        named = daemon_modules_imported(REPO / "daemon" / f"{layer}.py")
        assert not named & above, f"{layer}.py imports {sorted(named & above)}, above it"
    assert not daemon_modules_imported(REPO / "daemon" / "watcher.py") & set(LAYERS)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_modules_and_classes_stay_small_enough_to_hold_in_your_head(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= MAX_MODULE_LINES
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno is not None
            assert node.end_lineno - node.lineno + 1 <= MAX_CLASS_LINES, node.name
