"""The code's layout, held to what the README promises a newcomer.

- Every import inside the package is relative and names a file that exists
  at the path it names, from the importing file (no install needed to follow it).
- Folders are layers: daemon/core <- guard <- reviewer <- infra <- handlers/
  <- daemon/service <- daemon/commands; a folder imports only from those
  below it (the commands a person runs are the top, the foundation the bottom).
- The service's parts import only downward: process -> lifecycle -> reconcile
  -> owner -> batch -> jobs -> loop -> steps, and the watcher none of them.
- One owner of a set's life: only daemon/service/owner.py writes a set's
  state (`state.update`); the others return a Decision.
- Explicit wiring: no part assigns another part's attribute (`self.x.y = ...`,
  `daemon.x = ...`); a part gets what it uses when it is built.
- One concept per module: no module over ~500 lines, no class over ~300.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "handlers")
# Bottom to top: a folder may import from itself and the folders before it.
FOLDERS = ["daemon/core", "daemon/guard", "daemon/reviewer", "daemon/infra", "handlers",
           "daemon/service", "daemon/commands"]
SERVICE = REPO / "daemon" / "service"
LAYERS = ["process", "lifecycle", "reconcile", "owner", "batch", "jobs", "loop",
          "steps"]  # top to bottom
OWNER = SERVICE / "owner.py"  # the one writer of a set's state
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 310


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


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


def targets(path: Path) -> Iterator[Path]:
    """The files of our code that `path` imports (`from . import a, b`: each module)."""
    for node, target in imports(path):
        if target is None or not isinstance(node, ast.ImportFrom):
            continue
        if target.with_suffix(".py").is_file():
            yield target.with_suffix(".py")
        else:
            yield from (target / f"{alias.name}.py" for alias in node.names
                        if (target / f"{alias.name}.py").is_file())


def folder_of(path: Path) -> str | None:
    rel = path.parent.relative_to(REPO).as_posix()
    return rel if rel in FOLDERS else None


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_a_folder_imports_only_from_the_folders_below_it(path: Path) -> None:
    mine = folder_of(path)
    if mine is None:
        return  # daemon/__main__.py, the package faces
    for target in targets(path):
        theirs = folder_of(target)
        assert theirs is not None, f"{target} is in no layer"
        assert FOLDERS.index(theirs) <= FOLDERS.index(mine), (
            f"{path.relative_to(REPO)} imports {target.relative_to(REPO)}, a layer above it")


def test_every_module_is_in_a_layer() -> None:
    loose = [p.relative_to(REPO) for p in modules()
             if folder_of(p) is None and p.name not in ("__init__.py", "__main__.py")]
    assert loose == []


def test_the_services_parts_import_only_downward() -> None:
    for i, layer in enumerate(LAYERS):
        above = {SERVICE / f"{name}.py" for name in LAYERS[:i]}
        named = set(targets(SERVICE / f"{layer}.py"))
        assert not named & above, f"{layer}.py imports {sorted(named & above)}, above it"
    assert not set(targets(SERVICE / "watcher.py")) & {SERVICE / f"{n}.py" for n in LAYERS}


def test_the_package_faces_define_nothing() -> None:
    # `from . import a, b` then always names modules, and a reader finds each by path.
    for init in [*REPO.glob("daemon/**/__init__.py"), REPO / "handlers" / "__init__.py"]:
        body = ast.parse(init.read_text(encoding="utf-8")).body
        docstring = body[:1] if body and isinstance(body[0], ast.Expr) else []
        assert body == docstring, init


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_modules_and_classes_stay_small_enough_to_hold_in_your_head(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= MAX_MODULE_LINES
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno is not None
            assert node.end_lineno - node.lineno + 1 <= MAX_CLASS_LINES, node.name


def _state_updates(tree: ast.AST) -> Iterator[int]:
    """Lines that call `<...>state.update(...)`: a set's state written."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "update":
            owner = node.func.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "state") or \
                    (isinstance(owner, ast.Name) and owner.id == "state"):
                yield node.lineno


def test_only_the_owner_writes_a_sets_state() -> None:
    writers = {f"{path.relative_to(REPO)}:{line}" for path in modules() if path != OWNER
               for line in _state_updates(ast.parse(path.read_text(encoding="utf-8")))}
    assert writers == set(), "a set's state is written only by daemon/service/owner.py"
    assert list(_state_updates(ast.parse(OWNER.read_text(encoding="utf-8"))))  # the probe works


def _assigned_attributes(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for each in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(each, ast.Attribute):
                    yield node.lineno, ast.unparse(each)


def test_no_part_of_the_service_assigns_another_parts_attribute() -> None:
    reaching = []
    for path in sorted(SERVICE.glob("*.py")):
        for line, target in _assigned_attributes(ast.parse(path.read_text(encoding="utf-8"))):
            # self.x = ... is a part's own field; self.x.y = ..., daemon.x = ... are not.
            if target.startswith("self.") and target.count(".") > 1 \
                    or target.startswith(("daemon.", "jobs.", "revisits.", "batcher.")):
                reaching.append(f"{path.name}:{line} {target}")
    assert reaching == []


# Issue 34: the guard has the last word on runs/. Every write of a file goes
# through daemon/guard/sealed_write.py, which reads the final text; these are
# the only other writers, each for a reason (module -> calls it may make).
WRITERS: dict[str, set[str]] = {
    # the primitive under sealed_write (temp file, fsync, rename)
    "daemon/core/atomic.py": {"os.open", "replace", "write_all"},
    # the state database: its rows are checked against every key by
    # daemon/infra/state.py before they reach it; a bad one is moved aside
    "daemon/core/state_db.py": {"sqlite3.connect", "os.open", "rename"},
    "daemon/infra/state.py": {"rename"},  # state.json -> .migrated, content unchanged
    # a report of a set the step no longer has, moved aside, content unchanged
    "daemon/service/retire.py": {"replace"},
    "daemon/core/lock.py": {"os.open"},  # daemon.lock: the pid
    # the JSON log: every record through the answer-key seal, its last processor
    "daemon/infra/log.py": {"WatchedFileHandler"},
    # the systemd unit and logrotate file, outside runs/
    "daemon/commands/service_unit.py": {"write_text", "replace"},
    # stdout to /dev/null once the reader of a pipe has gone
    "daemon/commands/cli.py": {"os.open"},
    "daemon/commands/tail.py": {"os.open"},
}
_WRITE_CALLS = {"write_text", "write_bytes", "write_all", "touch", "mkstemp", "fdopen",
                "dump", "replace", "rename", "copy", "copy2", "copyfile", "copytree", "move",
                "symlink_to", "hardlink_to", "link", "symlink", "mkfifo"}
_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}


def _names_attributes(tree: ast.AST) -> dict[str, set[str]]:
    """Name -> the attributes any assignment of it in the module reads: flags
    kept in a variable first (flags = os.O_WRONLY | ...) are still flags."""
    held: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    held.setdefault(target.id, set()).update(
                        n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute))
    return held


def _open_flags(call: ast.Call, named: dict[str, set[str]]) -> set[str]:
    """The attributes an open() call names, its variables' included."""
    return set().union(*({n.attr} if isinstance(n, ast.Attribute) else named.get(n.id, set())
                         for n in ast.walk(call) if isinstance(n, ast.Attribute | ast.Name)))


def _writes(path: Path) -> set[str]:
    """The calls of `path` that create or change a file, by name."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    named = _names_attributes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.endswith("FileHandler"):
            found.add(node.attr)
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        owner = func.value if isinstance(func, ast.Attribute) else None
        owner_name = owner.id if isinstance(owner, ast.Name) else ""
        if owner_name == "sealed_write":
            continue  # the boundary itself
        if name in ("replace", "copy") and owner_name not in ("os", "shutil") and (
                isinstance(owner, ast.Constant) or len(node.args) != 1):
            continue  # str.replace(a, b), dict.copy(): not files
        if name == "open":
            flags = _open_flags(node, named)
            modes = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
            modes += [k.value.value for k in node.keywords
                      if k.arg == "mode" and isinstance(k.value, ast.Constant)]
            if owner_name == "os" and flags & _WRITE_FLAGS:
                found.add("os.open")
            elif any(isinstance(m, str) and set(m) & set("wax+") for m in modes):
                found.add("open")
        elif name == "connect" and owner_name == "sqlite3":
            found.add("sqlite3.connect")
        elif name in _WRITE_CALLS:
            found.add(name)
    return found


def test_every_file_under_runs_is_written_through_the_sealed_writer() -> None:
    unsanctioned = {}
    for path in modules():
        rel = path.relative_to(REPO).as_posix()
        extra = _writes(path) - WRITERS.get(rel, set())
        if rel != "daemon/guard/sealed_write.py" and extra:
            unsanctioned[rel] = sorted(extra)
    assert unsanctioned == {}, "write through daemon/guard/sealed_write.py"
