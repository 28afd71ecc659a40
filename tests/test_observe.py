"""What a set looks like on disk (daemon/service/observe.py), case by case:
complete, still being written, or something that will not finish by itself
(a link out of runs/ or into the answer key, a folder or a misspelt name
where an episode should be, _SUCCESS with an episode missing). Real files
under tmp_path; no daemon."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from skilltrain.daemon.core import layout
from skilltrain.daemon.service.observe import Observation, observe, sigs_digest

KEY = layout.SetKey("r1", 1, 1, "alpha", 1, 3)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(runs, data, scripts) with ep01..03 written."""
    runs, data = tmp_path / "runs", tmp_path / "data"
    (data / "alpha" / "human").mkdir(parents=True)
    (data / "alpha" / "human" / "ep02.txt").write_text("INT. THE KEY - DAY\n")
    scripts = KEY.scripts_dir(runs)
    scripts.mkdir(parents=True)
    for n in (1, 2, 3):
        (scripts / f"ep{n:02d}.txt").write_text(f"INT. DRAFT {n} - DAY\n")
    return runs, data, scripts


def look(tree: tuple[Path, Path, Path]) -> Observation:
    runs, data, _ = tree
    return observe(KEY, runs, data)


def test_a_complete_range_has_a_signature_per_episode(tree: tuple[Path, Path, Path]) -> None:
    obs = look(tree)
    assert obs.complete and not obs.unusable and not obs.success_marker
    assert [n for n, _ in obs.sigs] == [1, 2, 3]
    assert obs.newest_mtime_ns == max(p.stat().st_mtime_ns for p in tree[2].glob("ep*.txt"))


def test_a_rewritten_episode_changes_the_signature(tree: tuple[Path, Path, Path]) -> None:
    before = sigs_digest(look(tree).sigs)
    (tree[2] / "ep03.txt").write_text("INT. A LONGER NEW DRAFT - NIGHT\n")
    assert sigs_digest(look(tree).sigs) != before


def test_a_missing_episode_is_still_being_written(tree: tuple[Path, Path, Path]) -> None:
    (tree[2] / "ep03.txt").unlink()
    obs = look(tree)
    assert obs.problem == "ep03.txt missing" and not obs.unusable and obs.sigs == ()


def test_an_empty_episode_is_flagged_for_its_settle_window(tree: tuple[Path, Path, Path]) -> None:
    (tree[2] / "ep02.txt").write_bytes(b"")
    obs = look(tree)
    assert obs.zero_byte and not obs.complete and not obs.unusable


def test_success_newer_than_the_episodes_says_finished_and_an_older_one_does_not(
    tree: tuple[Path, Path, Path],
) -> None:
    success = tree[2] / "_SUCCESS"
    success.write_bytes(b"")
    assert look(tree).success_marker
    old = (tree[2] / "ep01.txt").stat().st_mtime_ns - 10**9
    os.utime(success, ns=(old, old))  # left over from an earlier write
    assert not look(tree).success_marker


def _link_out(tree: tuple[Path, Path, Path]) -> None:
    outside = tree[0].parent / "elsewhere.txt"
    outside.write_text("INT. OUTSIDE - DAY\n")
    (tree[2] / "ep02.txt").unlink()
    (tree[2] / "ep02.txt").symlink_to(outside)


def _link_to_the_key(tree: tuple[Path, Path, Path]) -> None:
    (tree[2] / "ep02.txt").unlink()
    (tree[2] / "ep02.txt").symlink_to(tree[1] / "alpha" / "human" / "ep02.txt")


def _folder_for_an_episode(tree: tuple[Path, Path, Path]) -> None:
    (tree[2] / "ep02.txt").unlink()
    (tree[2] / "ep02.txt").mkdir()


def _misspelt(tree: tuple[Path, Path, Path]) -> None:
    (tree[2] / "ep02.txt").rename(tree[2] / "ep2.txt")


def _success_with_a_gap(tree: tuple[Path, Path, Path]) -> None:
    (tree[2] / "ep03.txt").unlink()
    (tree[2] / "_SUCCESS").write_bytes(b"")


def _scripts_linked_out(tree: tuple[Path, Path, Path]) -> None:
    runs, _, scripts = tree
    moved = runs.parent / "moved-scripts"
    scripts.rename(moved)
    scripts.symlink_to(moved)


@pytest.mark.parametrize("spoil, says", [
    (_link_out, "a symlink out of runs/"),
    (_link_to_the_key, "answer key"),
    (_folder_for_an_episode, "not a regular file"),
    (_misspelt, "found ep2.txt"),
    (_success_with_a_gap, "_SUCCESS says the writer finished"),
    (_scripts_linked_out, "scripts is a symlink out of runs/"),
])
def test_what_will_not_finish_by_itself_is_unusable(
    tree: tuple[Path, Path, Path], spoil: Callable[[tuple[Path, Path, Path]], None], says: str,
) -> None:
    spoil(tree)
    obs = look(tree)
    assert obs.unusable and not obs.complete and obs.sigs == ()
    assert obs.problem is not None and says in obs.problem, obs.problem
