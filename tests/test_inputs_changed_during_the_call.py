"""Inputs changed during the call, in every way a writer can: finish refuses.

finish() reads both ranges again just before writing and compares their
digests with what the prompt was made from. It does not trust a stat for
that: a write through a shared mmap leaves the mtime and ctime as they were
(until writeback, or forever on tmpfs), and an NFS client answers a stat
from its attribute cache, while open() revalidates (close-to-open). Each
change here must end in InputsChangedError with nothing written, the first
with the stat unmoved.
"""
from __future__ import annotations

import mmap
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


def _rewrite_same_size(path: Path) -> None:
    time.sleep(0.05)  # past the file system's timestamp tick
    text = path.read_text(encoding="utf-8")
    path.write_text(text[::-1] if text[::-1] != text else text.upper(), encoding="utf-8")


def _rewrite_keeping_mtime(path: Path) -> None:
    st = path.stat()
    _rewrite_same_size(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _replace_by_rename(path: Path) -> None:
    fresh = path.with_name("fresh.tmp")
    fresh.write_bytes(path.read_bytes().swapcase())
    os.replace(fresh, path)


def _link_to_the_key(path: Path, key: Path) -> None:
    path.unlink()
    path.symlink_to(key / path.name)


def _folder_swapped_for_a_link(path: Path) -> None:
    folder = path.parent
    copy = folder.with_name("copy")
    shutil.copytree(folder, copy)
    (copy / path.name).write_bytes((copy / path.name).read_bytes().swapcase())
    shutil.rmtree(folder)
    folder.symlink_to(copy)


def _swapped_for(path: Path, make: Callable[[Path], None]) -> None:
    path.unlink()
    make(path)


CHANGES: dict[str, Callable[[Path, Path], None]] = {
    "rewritten, same size": lambda p, key: _rewrite_same_size(p),
    "rewritten, mtime put back": lambda p, key: _rewrite_keeping_mtime(p),
    "replaced by a rename": lambda p, key: _replace_by_rename(p),
    "deleted": lambda p, key: p.unlink(),
    "a link to the answer key": _link_to_the_key,
    "its folder swapped for a link": lambda p, key: _folder_swapped_for_a_link(p),
    # The check reads bytes only: what never ends or never answers is a change too.
    "a link to a device that never ends": lambda p, key: _swapped_for(
        p, lambda q: q.symlink_to("/dev/zero")),
    "a FIFO": lambda p, key: _swapped_for(p, os.mkfifo),
}


@pytest.mark.parametrize(("change", "side"), [
    (change, side) for change in CHANGES for side in ("model", "human")
    if (change, side) != ("a link to the answer key", "human")])  # the key itself
def test_an_input_changed_during_the_call_is_refused(
        workspace: tuple[loss.LossJob, Path], change: str, side: str) -> None:
    job, runs = workspace
    prepared = prepare(job, runs)
    folder = job.scripts_dir if side == "model" else job.work.human_dir
    CHANGES[change](folder / "ep02.txt", job.work.human_dir)
    with pytest.raises(InputsChangedError):
        finish(prepared)
    assert not job.report_path.exists()


@pytest.mark.parametrize("side", ["model", "human"])
def test_a_write_through_a_shared_mapping_is_refused_though_the_stat_does_not_move(
        workspace: tuple[loss.LossJob, Path], side: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The answer key's text is kept while its stat holds (dataset._kept_text):
    # settled at once here, so that the prompt's key comes from that cache.
    monkeypatch.setattr(dataset, "racily_clean", lambda changed_ns: False)
    job, runs = workspace
    path = (job.scripts_dir if side == "model" else job.work.human_dir) / "ep02.txt"
    prepare(job, runs)  # the key kept
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:
        mapped[0:1] = mapped[0:1]  # the page is dirty: later stores move no time
        prepare_stat = path.stat()
        prepared = prepare(job, runs)
        mapped[10:60] = mapped[10:60].swapcase()
        after = path.stat()
        if (after.st_mtime_ns, after.st_ctime_ns) != (prepare_stat.st_mtime_ns,
                                                      prepare_stat.st_ctime_ns):
            pytest.skip("this file system moved the times on a mapped store")
        with pytest.raises(InputsChangedError):
            finish(prepared)
    assert not job.report_path.exists()
    # The next job's prompt has the text as it is now, and its report is written.
    again = prepare(job, runs)
    assert path.read_text(encoding="utf-8") in again.prompt
    finish(again)
    assert job.report_path.exists()


def test_a_changed_key_is_read_from_the_disk_next_time_even_when_the_model_changed_too(
        workspace: tuple[loss.LossJob, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # The model's change is named first; the key's text kept for the next job
    # (a change that moved no time) is dropped all the same.
    job, runs = workspace
    prepared = prepare(job, runs)
    forgotten: list[str] = []
    monkeypatch.setattr(dataset, "forget_kept", lambda paths: forgotten.extend(map(str, paths)))
    _rewrite_same_size(job.scripts_dir / "ep02.txt")
    _rewrite_same_size(job.work.human_dir / "ep02.txt")
    with pytest.raises(InputsChangedError, match="model episodes"):
        finish(prepared)
    assert str(job.work.human_dir / "ep02.txt") in forgotten


def test_the_check_reads_regular_files_only(tmp_path: Path) -> None:
    # Unbounded, a link to a device would be read for ever: it is no input.
    zero, fifo = tmp_path / "ep01.txt", tmp_path / "ep02.txt"
    zero.symlink_to("/dev/zero")
    os.mkfifo(fifo)
    assert dataset.files_digest({1: str(zero)}) is None
    assert dataset.files_digest({2: str(fifo)}) is None
