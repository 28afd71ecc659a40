"""The inputs checked after the call by their stat, not read again (dataset.Seen).

A report is written only if the files it was made from are still what was
read. finish() asks their stat first: the same device, inode, size, mtime
and ctime say nothing was written (a write moves the ctime, which no one can
set back), and the files are not read again. Anything else, or a file that
had changed within the clock's tick of its read, or one read through a link,
is read again and compared by its digest, as before. These tests take the
stat path (RACY_MTIME_NS off: the example files are not "just written") and
change the inputs in every way the stat must show.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from skilltrain.daemon.core import dataset
from skilltrain.daemon.core.config import LLMConfig
from skilltrain.daemon.core.errors import InputsChangedError
from skilltrain.daemon.core.templates import PromptTemplates
from skilltrain.daemon.infra import llm
from skilltrain.handlers import loss

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "data" / "example"
REPORT = ("The draft states feelings outright where the original lets a look carry them. "
          "Scenes in the draft start early and end late; the original enters late.")
SETTINGS = LLMConfig(model="openai/loopback-model", api_base="http://127.0.0.1:9", timeout_s=5.0)


@pytest.fixture
def workspace(tmp_path: Path) -> tuple[loss.LossJob, Path]:
    """A run's scripts/ (the example's draft, ep01-03) and a copy of the example work."""
    scripts = tmp_path / "runs" / "r1" / "epoch_00" / "step_00" / "example" / "scripts"
    scripts.mkdir(parents=True)
    for n in (1, 2, 3):
        shutil.copy(EXAMPLE / "model_draft" / f"ep{n:02d}.txt", scripts)
    work = tmp_path / "data" / "example"
    shutil.copytree(EXAMPLE / "human", work / "human")
    shutil.copy(EXAMPLE / "work.toml", work)
    report = tmp_path / "runs" / "r1" / "loss" / "epoch_00" / "step_00" / "example_ep01-03.md"
    job = loss.LossJob(work=dataset.load_work(work), scripts_dir=scripts, report_path=report,
                       first=1, last=3)
    return job, tmp_path / "runs"


def prepare(job: loss.LossJob, runs: Path) -> loss.Prepared:
    return loss.prepare(job, settings=SETTINGS, templates=PromptTemplates(REPO / "prompts"),
                        confine_to=runs, answer_key=job.work.human_dir)


def finish(prepared: loss.Prepared) -> loss.LossResult:
    completion = llm.Completion(text=REPORT, finish_reason="stop", tokens_in=10, tokens_out=10,
                                tokens_cached=0, cost_usd=None, attempts=1)
    return loss.finish(prepared, completion)


def counting_reads(prepared: loss.Prepared) -> tuple[loss.Prepared, list[int]]:
    """`prepared` whose read-again is counted."""
    calls: list[int] = []

    def read_again() -> tuple[dict[int, str], dict[int, str]]:
        calls.append(1)
        return prepared.read_inputs()

    return dataclasses.replace(prepared, read_inputs=read_again), calls


@pytest.fixture
def not_racy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataset, "RACY_MTIME_NS", -10**12)


@pytest.mark.usefixtures("not_racy")
def test_inputs_the_stat_shows_unchanged_are_not_read_again(
        workspace: tuple[loss.LossJob, Path]) -> None:
    job, runs = workspace
    prepared, reads = counting_reads(prepare(job, runs))
    assert len(prepared.seen) == 6 and all(v is not None for v in prepared.seen.values())
    finish(prepared)
    assert reads == []
    assert job.report_path.exists()


def _tick() -> None:
    time.sleep(0.05)  # past the file system's timestamp tick (jiffies: 1-10 ms)


def _rewrite_same_size(path: Path) -> None:
    _tick()
    text = path.read_text(encoding="utf-8")
    path.write_text(text[::-1] if text[::-1] != text else text.upper(), encoding="utf-8")


def _rewrite_keeping_mtime(path: Path) -> None:
    st = path.stat()
    _rewrite_same_size(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the ctime still moves


def _replace_by_rename(path: Path) -> None:
    fresh = path.with_name("fresh.tmp")
    fresh.write_bytes(path.read_bytes().swapcase())
    os.replace(fresh, path)


def _link_to_the_key(path: Path, key: Path) -> None:
    path.unlink()
    path.symlink_to(key / path.name)


def _folder_swapped_for_a_copy(path: Path) -> None:
    folder = path.parent
    copy = folder.with_name("copy")
    shutil.copytree(folder, copy)
    (copy / path.name).write_bytes((copy / path.name).read_bytes().swapcase())
    shutil.rmtree(folder)
    folder.symlink_to(copy)


CHANGES: dict[str, Callable[[Path, Path], None]] = {
    "rewritten, same size": lambda p, key: _rewrite_same_size(p),
    "rewritten, mtime put back": lambda p, key: _rewrite_keeping_mtime(p),
    "replaced by a rename": lambda p, key: _replace_by_rename(p),
    "deleted": lambda p, key: p.unlink(),
    "a link to the answer key": _link_to_the_key,
    "its folder swapped for a link": lambda p, key: _folder_swapped_for_a_copy(p),
}


@pytest.mark.usefixtures("not_racy")
@pytest.mark.parametrize(("change", "side"), [
    (change, side) for change in CHANGES for side in ("model", "human")
    if (change, side) != ("a link to the answer key", "human")])  # the key itself
def test_an_input_changed_after_its_read_is_read_again_and_refused(
        workspace: tuple[loss.LossJob, Path], change: str, side: str) -> None:
    job, runs = workspace
    prepared, reads = counting_reads(prepare(job, runs))
    folder = job.scripts_dir if side == "model" else job.work.human_dir
    CHANGES[change](folder / "ep02.txt", job.work.human_dir)
    with pytest.raises(InputsChangedError):
        finish(prepared)
    assert reads == [1]
    assert not job.report_path.exists()


def test_an_input_changed_within_the_tick_of_its_read_is_read_again(
        workspace: tuple[loss.LossJob, Path]) -> None:
    """Just written (the fixture's files): the stat may not show a change made
    in the same tick, so the inputs are read again, and an equal digest lets it by."""
    job, runs = workspace
    prepared, reads = counting_reads(prepare(job, runs))
    assert all(v is None for v in prepared.seen.values())
    finish(prepared)
    assert reads == [1]
    assert job.report_path.exists()


@pytest.mark.usefixtures("not_racy")
def test_an_episode_read_through_a_link_is_read_again(
        workspace: tuple[loss.LossJob, Path]) -> None:
    job, runs = workspace
    real = job.scripts_dir.parent / "ep02-real.txt"
    (job.scripts_dir / "ep02.txt").rename(real)
    (job.scripts_dir / "ep02.txt").symlink_to(real)
    prepared, reads = counting_reads(prepare(job, runs))
    assert prepared.seen[job.scripts_dir / "ep02.txt"] is None
    finish(prepared)
    assert reads == [1]



@pytest.mark.usefixtures("not_racy")
@pytest.mark.parametrize("edit", ["rewritten, same size", "rewritten, mtime put back"])
def test_a_template_edited_after_its_read_is_read_again(tmp_path: Path, edit: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The template is read again only when its stat moved (PromptTemplates.load)."""
    prompts = tmp_path / "prompts"
    shutil.copytree(REPO / "prompts", prompts)
    templates = PromptTemplates(prompts)
    first = templates.load(loss.TEMPLATE)
    reads: list[Path] = []
    read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: reads.append(p) or read_bytes(p))
    assert templates.load(loss.TEMPLATE).source_hash == first.source_hash
    assert reads == []
    path = templates.path(loss.TEMPLATE)
    st = path.stat()
    _tick()
    text = path.read_text(encoding="utf-8")
    assert " the " in text
    path.write_text(text.replace(" the ", " THE ", 1), encoding="utf-8")  # the same size
    if edit == "rewritten, mtime put back":
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    reads.clear()
    again = templates.load(loss.TEMPLATE)
    assert reads == [path]
    assert again.source_hash != first.source_hash
    assert again.source_hash == hashlib.sha256(path.read_bytes()).hexdigest()
