"""Looking at one set on disk: is its range complete, settled, up to date?

Only `stat` calls on the hot path. A set's fingerprint is the stat
signature (size, mtime_ns, inode, ctime_ns) of each model episode plus the
hashes of the human range, the template and the model id; while the
fingerprint equals the one recorded when its report was written, the report
is up to date without reading a byte. When it differs, the sidecar's content
hashes decide (a `touch` or a `chmod` is not a change).
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ...handlers import loss
from ..core import dataset
from ..core.errors import RefusedError
from ..core.layout import SUCCESS_MARKER, SetKey
from ..core.templates import PromptTemplates


@dataclass(frozen=True)
class FileSig:
    """What `stat` says of a file's bytes without reading them.

    ctime as well as mtime: an in-place rewrite of the same size with its
    mtime put back (`rsync --inplace -t`, `touch -r`, `cp --preserve`) keeps
    size, mtime and inode, and only ctime moves (no ordinary call can set it back).
    ctime also moves without the text changing (chmod, a new hard link):
    then the content hashes say "unchanged" and only the fingerprint is renewed.
    """

    size: int
    mtime_ns: int
    ino: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileSig:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


@dataclass(frozen=True)
class Observation:
    """What the writer's side of a set looks like right now."""

    key: SetKey
    sigs: tuple[tuple[int, FileSig], ...]  # every episode of the range, when complete
    problem: str | None  # why the range is not complete; None when it is
    success_marker: bool
    newest_mtime_ns: int
    # The problem will not go away by the writer finishing: a symlink out of
    # runs/ or into data/, a folder where a file should be, an unreadable
    # file, a misspelt episode name, _SUCCESS with an episode missing.
    unusable: bool = False
    # An episode is a zero-byte file: normal for an instant (created, not yet
    # written), a problem once it has stayed so for the settle window.
    zero_byte: bool = False

    @property
    def complete(self) -> bool:
        return self.problem is None

    def ready_at(self, settle_s: float) -> float:
        """Wall-clock time at which the range counts as finished writing."""
        if self.success_marker:
            return 0.0
        return self.newest_mtime_ns / 1e9 + settle_s


def observe(key: SetKey, runs: Path, answer_key: Path | None = None) -> Observation:
    """`answer_key`: data/; an episode or folder whose real path is in it is unusable."""
    # Plain strings and os.lstat: this runs for every set at every scan, and
    # pathlib's joins were a third of a 20,000-set scan's time.
    scripts = key.scripts_folder(runs)
    folder_problem = _folder_problem(scripts, runs, answer_key)
    if folder_problem is not None:
        return Observation(key, (), folder_problem, False, 0, unusable=True)
    sigs: list[tuple[int, FileSig]] = []
    problem = None
    unusable = False
    missing: list[int] = []
    newest = 0
    zero_byte = False
    for n in range(key.first, key.last + 1):
        name = dataset.episode_name(n)
        path = f"{scripts}/{name}"
        try:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                st = os.stat(dataset.confine(path, runs, answer_key=answer_key))
        except (FileNotFoundError, NotADirectoryError):
            missing.append(n)
            problem = problem or f"{name} missing"
            continue
        except RefusedError as e:
            problem = problem or str(e)
            unusable = True
            continue
        except OSError as e:
            problem = problem or f"{name} cannot be read ({e.strerror or type(e).__name__})"
            unusable = True
            continue
        newest = max(newest, st.st_mtime_ns)
        if not stat.S_ISREG(st.st_mode):
            problem = problem or f"{name} is not a regular file"
            unusable = True
        elif st.st_size == 0:
            problem = problem or f"{name} is empty (0 bytes)"
            zero_byte = True
        else:
            sigs.append((n, FileSig.of(st)))
    marker = _marks_finished(f"{scripts}/{SUCCESS_MARKER}", newest)
    if problem is not None and not unusable:
        problem, unusable = _explain_incomplete(scripts, problem, missing, marker)
    return Observation(key, tuple(sigs) if problem is None else (), problem, marker, newest,
                       unusable, zero_byte)


def _explain_incomplete(scripts: str, problem: str, missing: list[int],
                        marker: bool) -> tuple[str, bool]:
    """(problem, unusable) of a range that looks merely unfinished: it will not
    finish by itself when an episode is there under a wrong name, or when
    _SUCCESS says the writer is done."""
    misnamed = _misnamed(scripts, missing) if missing else None
    if misnamed is not None:
        return misnamed, True
    if marker:
        return f"{problem}, but {SUCCESS_MARKER} says the writer finished", True
    return problem, False


def _folder_problem(scripts: str, runs: Path, answer_key: Path | None) -> str | None:
    """Why the work or scripts/ folder cannot be used: a link out of runs/ or into
    data/, a file where the folder should be. None when usable or not there yet."""
    work_dir = scripts.rsplit("/", 1)[0]
    for folder in (work_dir, scripts):
        try:
            st = os.lstat(folder)
            if stat.S_ISLNK(st.st_mode):
                st = os.stat(dataset.confine(folder, runs, answer_key=answer_key))
        except FileNotFoundError:
            return None  # not written yet: its episodes are "missing"
        except RefusedError as e:
            return str(e)
        except OSError as e:
            return f"{folder} cannot be read ({e.strerror or type(e).__name__})"
        if not stat.S_ISDIR(st.st_mode):
            return f"{folder} is a file, not a folder"
    return None


# What a writer may have meant by an episode name: ep1.txt, EP01.TXT, Ep001.txt.
_LOOSE_EPISODE_NAME = re.compile(r"ep0*(\d+)\.txt", re.IGNORECASE)


def _misnamed(scripts: str, missing: list[int]) -> str | None:
    """A missing episode present under another spelling: name both, once."""
    try:
        names = os.listdir(scripts)
    except OSError:
        return None
    for name in sorted(names):
        match = _LOOSE_EPISODE_NAME.fullmatch(name)
        if match is None or int(match.group(1)) not in missing:
            continue
        expected = dataset.episode_name(int(match.group(1)))
        if name != expected:
            return (f"{expected} missing; found {name}, which is not an episode name "
                    "(ep + two or more digits + .txt, lower case)")
    return None


def _marks_finished(marker: str, newest_episode_mtime_ns: int) -> bool:
    """_SUCCESS counts only if written after the newest episode: one left over
    from an earlier write must not skip the settle wait of a rewrite."""
    try:
        st = os.stat(marker)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_mtime_ns >= newest_episode_mtime_ns


def sigs_digest(sigs: tuple[tuple[int, FileSig], ...]) -> str:
    """The stat signatures of a range, short: the state keeps one per set, the
    sidecar one per report (model_stat_sigs).

    One kept by a daemon from before ctime was in it never equals a new one:
    its report is then judged by the content hashes once (a re-hash, not a
    new report) and the new signature recorded.
    """
    text = ";".join(f"{n}:{s.size}:{s.mtime_ns}:{s.ino}:{s.ctime_ns}" for n, s in sigs)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """Everything a report depends on, cheap to compare."""

    sigs: str  # sigs_digest() of the model episodes' stat signatures
    human: str
    template: str
    model_id: str

    @classmethod
    def of(cls, sigs: tuple[tuple[int, FileSig], ...], human: str, template: str,
           model_id: str) -> Fingerprint:
        return cls(sigs_digest(sigs), human, template, model_id)

    def as_json(self) -> dict[str, object]:
        return {"sigs": self.sigs, "human": self.human, "template": self.template,
                "model_id": self.model_id}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Fingerprint | None:
        try:
            return cls(str(data["sigs"]), str(data["human"]), str(data["template"]),
                       str(data["model_id"]))
        except (KeyError, TypeError):
            return None


class HumanDigests:
    """Digest of each human range, recomputed only when a human file's stat changes.

    The stats themselves are trusted for `recheck_s`: a scan asks for the same
    range once per run, epoch and step, and the answer key rarely changes.
    """

    def __init__(self, recheck_s: float = 1.0) -> None:
        self._cache: dict[tuple[str, int, int],
                          tuple[float, tuple[FileSig, ...], str | None]] = {}
        self._lock = threading.Lock()
        self._recheck_s = recheck_s

    def digest(self, work: dataset.Work, first: int, last: int) -> str | None:
        """None when the human range cannot be read (the loss job will refuse it)."""
        key = (work.name, first, last)
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(key)
        if cached and now - cached[0] < self._recheck_s:
            return cached[2]
        human_dir = str(work.human_dir)
        try:
            sigs = tuple(FileSig.of(os.stat(f"{human_dir}/{dataset.episode_name(n)}"))
                         for n in range(first, last + 1))
        except OSError:
            return None
        if cached and cached[1] == sigs:
            with self._lock:
                self._cache[key] = (now, sigs, cached[2])
            return cached[2]
        try:
            value: str | None = dataset.episodes_digest(work.read_human(first, last))
        except RefusedError:
            value = None
        with self._lock:
            self._cache[key] = (now, sigs, value)
        return value


def report_is_current(key: SetKey, runs: Path, fingerprint: Fingerprint,
                      recorded: Fingerprint | None) -> bool:
    """Is there a report made from exactly these inputs?

    Fast path: the fingerprint recorded at write time matches. Without it
    (restart with lost state, a touched file): the sidecar's input hashes, and
    the episodes' stat signature it kept (unchanged files) or, failing that,
    hashes of the files as they are now.
    """
    report = key.report_file(runs)
    sidecar = report[: -len(".md")] + ".json"  # loss.sidecar_path, without pathlib
    if not (os.path.isfile(sidecar) and os.path.isfile(report)):
        return False
    if recorded == fingerprint:
        return True
    data = loss.read_sidecar(Path(report))
    inputs = data.get("inputs") if data else None
    if data is None or not isinstance(inputs, dict):
        return False
    if (inputs.get("human_sha256") != fingerprint.human
            or inputs.get("template_sha256") != fingerprint.template
            or inputs.get("model_id") != fingerprint.model_id):
        return False
    if data.get("model_stat_sigs") == fingerprint.sigs:
        return True  # the files the job saw when it was queued, untouched since
    # Hashes of the bytes, not of the checked text: `observe` has just found
    # each episode a regular file confined to runs/, and a match only says
    # "nothing to do"; a job reads and checks the text in full before use.
    scripts = key.scripts_folder(runs)
    digest = dataset.files_digest({n: f"{scripts}/{dataset.episode_name(n)}"
                                   for n in range(key.first, key.last + 1)})
    return digest is not None and inputs.get("model_sha256") == digest


class ReportCheck:
    """The reconciler's "is the report up to date?", asked afresh of sets the
    state calls done: the step barrier's last look before the optimizer
    learns from them. Nothing cached across calls (the template is read, the
    human files stat'ed each time); only `stat` calls while nothing changed.
    """

    def __init__(self, runs: Path, answer_key: Path, prompts: Path, model_id: str) -> None:
        self.runs = runs
        self.answer_key = answer_key
        self.templates = PromptTemplates(prompts)
        self.model_id = model_id
        self.human_digests = HumanDigests(recheck_s=0.0)  # a digest is kept, its stats not

    def stale(self, keys: list[SetKey], works: dict[str, dataset.Work],
              recorded: dict[str, Fingerprint | None]) -> list[SetKey]:
        """The sets among `keys` whose report is not one of their inputs as they
        are on disk now. `recorded`: each set's fingerprint in the state.
        Raises ConfigError when the template cannot be read."""
        template = self.templates.source_hash(loss.TEMPLATE)
        stale = []
        for key in keys:
            obs = observe(key, self.runs, self.answer_key)
            work = works.get(key.work)
            human = (self.human_digests.digest(work, key.first, key.last)
                     if obs.complete and work is not None else None)
            if not human or not report_is_current(
                    key, self.runs, Fingerprint.of(obs.sigs, human, template, self.model_id),
                    recorded.get(key.id)):
                stale.append(key)
        return stale
