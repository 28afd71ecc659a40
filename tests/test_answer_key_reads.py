"""The answer key's episodes are read once per content, not once per set:
kept while their identity (inode, size, mtime, ctime) holds, never while
racily clean, and never for a writer's scripts; and a writer's scripts are
read from the folder that was checked, whatever its path says since."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from daemon.core import dataset

TEXT = "INT. KITCHEN - NIGHT\n\nANNA stirs the soup.\n"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file whose bytes are read."""
    seen: list[Path] = []
    real = dataset.read_bytes

    def counting(path: Path, *args: Any, **kwargs: Any) -> bytes | None:
        seen.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(dataset, "read_bytes", counting)
    dataset._kept_text.clear()
    return seen


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files count as changed long ago (the racy window is made empty)."""
    monkeypatch.setattr(dataset, "RACY_MTIME_NS", -10**12)


def _episode(tmp_path: Path, text: str = TEXT) -> Path:
    path = tmp_path / "human" / "ep01.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_a_settled_key_episode_is_read_once(tmp_path: Path, reads: list[Path],
                                            settled: None) -> None:
    path = _episode(tmp_path)
    for _ in range(3):
        assert dataset.read_episode(path, label="human episode") == TEXT
    assert reads == [path]


def test_a_key_episode_edited_in_place_is_read_again_even_with_size_and_mtime_kept(
        tmp_path: Path, reads: list[Path], settled: None) -> None:
    path = _episode(tmp_path)
    assert dataset.read_episode(path, label="human episode") == TEXT
    before = path.stat()
    edited = TEXT.replace("soup", "stew")
    assert len(edited) == len(TEXT)
    path.write_text(edited, encoding="utf-8")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # ctime still moves
    assert dataset.read_episode(path, label="human episode") == edited
    assert len(reads) == 2


def test_a_key_episode_replaced_by_rename_is_read_again(tmp_path: Path, reads: list[Path],
                                                        settled: None) -> None:
    path = _episode(tmp_path)
    dataset.read_episode(path, label="human episode")
    other = tmp_path / "new.txt"
    other.write_text(TEXT.upper(), encoding="utf-8")
    other.replace(path)
    assert dataset.read_episode(path, label="human episode") == TEXT.upper()


def test_a_just_written_key_episode_is_not_kept(tmp_path: Path, reads: list[Path]) -> None:
    # Within the clock's tick a second write may leave size, mtime and ctime as
    # they were: a file changed in the last RACY_MTIME_NS is read every time.
    path = _episode(tmp_path)
    dataset.read_episode(path, label="human episode")
    dataset.read_episode(path, label="human episode")
    assert reads == [path, path]


def test_a_writers_script_is_read_every_time(tmp_path: Path, reads: list[Path],
                                            settled: None) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    path = scripts / "ep01.txt"
    path.write_text(TEXT, encoding="utf-8")
    for _ in range(2):
        dataset.read_episode(path, label="model episode", confine_to=scripts,
                             answer_key=tmp_path / "human")
    assert reads == [path, path]


def test_a_kept_episode_still_refuses_what_it_would_refuse(tmp_path: Path, reads: list[Path],
                                                           settled: None) -> None:
    path = _episode(tmp_path)
    dataset.read_episode(path, label="human episode")
    with pytest.raises(dataset.RefusedError, match="limit"):
        dataset.read_episode(path, label="human episode", max_bytes=len(TEXT) - 1)
    path.unlink()
    with pytest.raises(dataset.RefusedError, match="missing"):
        dataset.read_episode(path, label="human episode")


def test_a_file_grown_since_its_stat_is_read_to_its_end(tmp_path: Path) -> None:
    # The size from the stat is a first guess, not a limit: what was appended
    # between the stat and the read is read too (the hashes then differ from
    # the next read's, and the set is redone, never cut short silently).
    path = tmp_path / "ep01.txt"
    path.write_text(TEXT * 5000, encoding="utf-8")
    assert dataset.read_bytes(path, len(TEXT)) == (TEXT * 5000).encode()


def test_a_scripts_folder_swapped_for_a_link_after_its_check_is_not_read_through(
    tmp_path: Path,
) -> None:
    # The range's folder is confined once and opened: a writer that moves it
    # away and links the answer key in its place afterwards gets its own
    # episode read, not the key's.
    runs, data = tmp_path / "runs", tmp_path / "data" / "w" / "human"
    scripts = runs / "r" / "scripts"
    for folder, text in ((scripts, "INT. MODEL - DAY\n\nA model line.\n"), (data, TEXT)):
        folder.mkdir(parents=True)
        (folder / "ep01.txt").write_text(text, encoding="utf-8")
    fd = dataset.open_confined(scripts, runs, tmp_path / "data", "model episode")
    assert fd is not None
    try:
        scripts.rename(runs / "r" / "moved")
        scripts.symlink_to(data, target_is_directory=True)
        text = dataset.read_episode(scripts / "ep01.txt", label="model episode",
                                    confine_to=runs, answer_key=tmp_path / "data",
                                    folder_fd=fd)
    finally:
        os.close(fd)
    assert "A model line." in text and "soup" not in text
    # Read afresh, the link is refused for where it leads.
    with pytest.raises(dataset.RefusedError, match="leads into the answer key"):
        dataset.read_range(scripts, 1, 1, label="model", confine_to=runs,
                           answer_key=tmp_path / "data")


@pytest.mark.parametrize("proc", [True, False], ids=["by-proc", "without-proc"])
def test_an_episode_link_flipped_between_its_check_and_its_open_is_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proc: bool) -> None:
    """A link at the episode itself is confined by its path, then opened by it:
    a writer flipping it to another work's answer key in between must not get
    that key read as its script (the other work's key is no copy of this one,
    so no later check would catch it)."""
    runs = tmp_path / "runs"
    scripts = runs / "r1" / "scripts"
    scripts.mkdir(parents=True)
    shared = runs / "r1" / "shared.txt"
    shared.write_text(TEXT, encoding="utf-8")
    other_key = tmp_path / "data" / "other" / "human" / "ep01.txt"
    other_key.parent.mkdir(parents=True)
    other_key.write_text("INT. VAULT - NIGHT\n\nThe other work's secret line.\n", encoding="utf-8")
    episode = scripts / "ep01.txt"
    episode.symlink_to(shared)
    confine = dataset.confine

    def flipped_after_the_check(path: str, root: Path | None, **kw: Any) -> str:
        real = confine(path, root, **kw)
        if path == str(episode):
            episode.unlink()
            episode.symlink_to(other_key)
        return real

    monkeypatch.setattr(dataset, "confine", flipped_after_the_check)
    if not proc:
        readlink = os.readlink
        monkeypatch.setattr(dataset.os, "readlink", lambda p, *a, **k: (
            (_ for _ in ()).throw(OSError("no /proc")) if str(p).startswith("/proc/")
            else readlink(p, *a, **k)))
    with pytest.raises(dataset.RefusedError, match=r"ep01\.txt is a symlink that changed while"):
        dataset.read_range(scripts, 1, 1, label="model", confine_to=runs,
                           answer_key=tmp_path / "data" / "work" / "human")
