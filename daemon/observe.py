"""Looking at one set on disk: is its range complete, settled, up to date?

Only `stat` calls on the hot path. A set's fingerprint is the stat
signature (size, mtime_ns, inode) of each model episode plus the hashes of
the human range, the template and the model id; while the fingerprint
equals the one recorded when its report was written, the report is up to
date without reading a byte. When it differs, the sidecar's content hashes
decide (a `touch` is not a change).
"""
from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from skilltrain import dataset
from skilltrain.errors import RefusedError
from skilltrain.handlers import loss
from skilltrain.layout import SUCCESS_MARKER, SetKey


@dataclass(frozen=True)
class FileSig:
    size: int
    mtime_ns: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileSig:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass(frozen=True)
class Observation:
    """What the writer's side of a set looks like right now."""

    key: SetKey
    sigs: tuple[tuple[int, FileSig], ...]  # every episode of the range, when complete
    problem: str | None  # why the range is not complete; None when it is
    success_marker: bool
    newest_mtime_ns: int

    @property
    def complete(self) -> bool:
        return self.problem is None

    def ready_at(self, settle_s: float) -> float:
        """Wall-clock time at which the range counts as finished writing."""
        if self.success_marker:
            return 0.0
        return self.newest_mtime_ns / 1e9 + settle_s


def observe(key: SetKey, runs: Path) -> Observation:
    scripts = key.scripts_dir(runs)
    sigs: list[tuple[int, FileSig]] = []
    problem = None
    newest = 0
    for n in range(key.first, key.last + 1):
        path = scripts / dataset.episode_name(n)
        try:
            st = _stat_confined(path, runs)
        except FileNotFoundError:
            problem = problem or f"{path.name} missing"
            continue
        except RefusedError as e:
            problem = problem or str(e)
            continue
        if not stat.S_ISREG(st.st_mode):
            problem = problem or f"{path.name} is not a regular file"
        elif st.st_size == 0:
            problem = problem or f"{path.name} is empty"
        else:
            sigs.append((n, FileSig.of(st)))
            newest = max(newest, st.st_mtime_ns)
    success = os.path.isfile(scripts / SUCCESS_MARKER)
    return Observation(key, tuple(sigs) if problem is None else (), problem, success, newest)


def _stat_confined(path: Path, runs: Path) -> os.stat_result:
    """stat, following a symlink only when it stays inside runs/."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        target = path.resolve()
        if not target.is_relative_to(runs.resolve()):
            raise RefusedError(f"{path.name} is a symlink out of runs/; not followed")
        st = target.stat()
    return st


@dataclass(frozen=True)
class Fingerprint:
    """Everything a report depends on, cheap to compare."""

    sigs: tuple[tuple[int, FileSig], ...]
    human: str
    template: str
    model_id: str

    def as_json(self) -> dict[str, object]:
        return {"sigs": [[n, s.size, s.mtime_ns, s.ino] for n, s in self.sigs],
                "human": self.human, "template": self.template, "model_id": self.model_id}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Fingerprint | None:
        try:
            raw_sigs = data["sigs"]
            assert isinstance(raw_sigs, list)
            sigs = tuple((int(n), FileSig(int(a), int(b), int(c))) for n, a, b, c in raw_sigs)
            return cls(sigs, str(data["human"]), str(data["template"]), str(data["model_id"]))
        except (KeyError, TypeError, ValueError, AssertionError):
            return None


class HumanDigests:
    """Digest of each human range, recomputed only when a human file's stat changes."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int, int], tuple[tuple[FileSig, ...], str | None]] = {}
        self._lock = threading.Lock()

    def digest(self, work: dataset.Work, first: int, last: int) -> str | None:
        """None when the human range cannot be read (the loss job will refuse it)."""
        paths = [work.human_dir / dataset.episode_name(n) for n in range(first, last + 1)]
        try:
            sigs = tuple(FileSig.of(p.stat()) for p in paths)
        except OSError:
            return None
        key = (work.name, first, last)
        with self._lock:
            cached = self._cache.get(key)
        if cached and cached[0] == sigs:
            return cached[1]
        try:
            value: str | None = dataset.episodes_digest(work.read_human(first, last))
        except RefusedError:
            value = None
        with self._lock:
            self._cache[key] = (sigs, value)
        return value


def report_is_current(key: SetKey, runs: Path, fingerprint: Fingerprint,
                      recorded: Fingerprint | None) -> bool:
    """Is there a report made from exactly these inputs?

    Fast path: the fingerprint recorded at write time matches. Slow path
    (restart with lost state, a touched file): compare the sidecar's content
    hashes with hashes of the files as they are now.
    """
    report = key.report_path(runs)
    if not (report.is_file() and loss.sidecar_path(report).is_file()):
        return False
    if recorded == fingerprint:
        return True
    sidecar = loss.read_sidecar(report)
    inputs = sidecar.get("inputs") if sidecar else None
    if not isinstance(inputs, dict):
        return False
    if (inputs.get("human_sha256") != fingerprint.human
            or inputs.get("template_sha256") != fingerprint.template
            or inputs.get("model_id") != fingerprint.model_id):
        return False
    try:
        model = dataset.read_range(key.scripts_dir(runs), key.first, key.last,
                                   label="model", confine_to=runs)
    except RefusedError:
        return False
    return bool(inputs.get("model_sha256") == dataset.episodes_digest(model))
