"""dataset.read_range's refusals, on Linux's O_PATH way and the portable one.

The Linux way opens a path only as a handle, asks the kernel where it led
(/proc/self/fd) and what it is, and opens that same file for reading only
once it is allowed: a FIFO or a device is never opened, and the file checked
is the file read. Both ways must refuse the same things with the same words.
"""
from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest

from skilltrain.daemon.core import dataset
from skilltrain.daemon.core.errors import RefusedError

TEXT = "INT. ROOM - DAY\n\nA line.\n"


@pytest.fixture(params=["o_path", "portable"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "portable":
        monkeypatch.setattr(dataset, "_O_PATH", 0)
    elif not dataset._O_PATH:
        pytest.skip("no O_PATH and /proc here")
    return str(request.param)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(runs root, scripts folder with ep01-03, answer key folder)."""
    runs, key = tmp_path / "runs", tmp_path / "data" / "w" / "human"
    scripts = runs / "r1" / "w" / "scripts"
    for folder in (scripts, key):
        folder.mkdir(parents=True)
        for n in (1, 2, 3):
            (folder / f"ep{n:02d}.txt").write_text(f"{TEXT}{folder.name} {n}\n", encoding="utf-8")
    return runs, scripts, key


def read(tree: tuple[Path, Path, Path], max_bytes: int | None = None) -> dict[int, str]:
    runs, scripts, key = tree
    return dataset.read_range(scripts, 1, 3, label="model", confine_to=runs,
                              answer_key=key.parent.parent, max_bytes=max_bytes)


def test_a_clean_range_reads_the_same_both_ways(way: str, tree: tuple[Path, Path, Path]) -> None:
    assert read(tree) == {n: f"{TEXT}scripts {n}\n" for n in (1, 2, 3)}


def test_a_link_inside_the_root_is_followed(way: str, tree: tuple[Path, Path, Path]) -> None:
    runs, scripts, _ = tree
    shared = runs / "shared.txt"
    (scripts / "ep02.txt").rename(shared)
    (scripts / "ep02.txt").symlink_to(shared)
    assert read(tree)[2] == f"{TEXT}scripts 2\n"


@pytest.mark.parametrize(("make", "said"), [
    ("into_key", r"ep02\.txt leads into the answer key \(.*\); not followed$"),
    ("out_of_runs", r"ep02\.txt is a symlink out of runs/; not followed$"),
    ("folder_out", r"scripts is a symlink out of runs/; not followed$"),
    ("dangling", r"ep02\.txt is a dangling symlink \(its target .* does not exist\)$"),
    ("loop", r"ep02\.txt is a symlink loop; not followed$"),
    ("fifo_out", r"ep02\.txt is a symlink out of runs/; not followed$"),
    ("device_link", r"ep02\.txt is a symlink out of runs/; not followed$"),
    ("fifo_inside", r"ep02\.txt is not a regular file$"),
    ("directory", r"ep02\.txt is not a regular file$"),
    ("missing", r"^model episode ep02\.txt is missing in .*/scripts$"),
])
def test_refused_with_the_same_words_both_ways(
        way: str, tree: tuple[Path, Path, Path], tmp_path: Path, make: str, said: str) -> None:
    runs, scripts, key = tree
    ep02 = scripts / "ep02.txt"
    ep02.unlink()
    if make == "into_key":
        ep02.symlink_to(key / "ep02.txt")
    elif make == "out_of_runs":
        (tmp_path / "elsewhere.txt").write_text(TEXT, encoding="utf-8")
        ep02.symlink_to(tmp_path / "elsewhere.txt")
    elif make == "folder_out":
        moved = tmp_path / "moved"
        scripts.rename(moved)
        scripts.symlink_to(moved, target_is_directory=True)
        (moved / "ep02.txt").write_text(TEXT, encoding="utf-8")
    elif make == "dangling":
        ep02.symlink_to(runs / "gone.txt")
    elif make == "loop":
        ep02.symlink_to("ep02.txt")
    elif make == "fifo_out":
        os.mkfifo(tmp_path / "pipe")
        ep02.symlink_to(tmp_path / "pipe")
    elif make == "device_link":
        ep02.symlink_to("/dev/zero")
    elif make == "fifo_inside":
        os.mkfifo(ep02)
    elif make == "directory":
        ep02.mkdir()
    result: list[BaseException] = []

    def attempt() -> None:
        try:
            read(tree)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            result.append(e)

    reader = threading.Thread(target=attempt, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "blocked opening a FIFO"
    assert isinstance(result[0], RefusedError), result
    assert re.search(said, str(result[0])), str(result[0])


def test_the_range_size_is_said_before_a_missing_episode(
        way: str, tree: tuple[Path, Path, Path]) -> None:
    _, scripts, _ = tree
    (scripts / "ep03.txt").unlink()
    with pytest.raises(RefusedError, match=r"total \d+ bytes, over the 60-byte limit"):
        read(tree, max_bytes=60)


def test_a_human_episode_may_not_be_a_symlink(way: str, tree: tuple[Path, Path, Path]) -> None:
    _, scripts, key = tree
    (key / "ep02.txt").unlink()
    (key / "ep02.txt").symlink_to(scripts / "ep02.txt")
    with pytest.raises(RefusedError, match=r"ep02\.txt is a symlink out of its folder"):
        dataset.read_range(key, 1, 3, label="human")


def test_no_descriptor_is_left_open(way: str, tree: tuple[Path, Path, Path]) -> None:
    before = len(os.listdir("/proc/self/fd"))
    _, scripts, _ = tree
    (scripts / "ep03.txt").write_bytes(b"\xff\xfe")
    for _ in range(20):
        with pytest.raises(RefusedError):
            read(tree)
    assert len(os.listdir("/proc/self/fd")) <= before
