"""The daemon's leak audit of runs/ at start, in the background.

Files found clean before, unchanged since (size, mtime, inode) and checked
against the same answer keys are skipped: on a large tree the first audit
costs minutes of CPU, the next ones seconds. Hits are logged without their
text (the excerpts are human text; `skilltrain audit` prints them to the
terminal, never into runs/).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ..core import dataset, layout, textnorm
from ..guard import audit, leakguard, sealed_write

CACHE = "audit-cache.json"  # in runs/.skilltrain/

Emit = Callable[..., None]


def audit_runs(runs: Path, works: Mapping[str, dataset.Work], data_root: Path,
               emit: Emit) -> None:
    """Audit every file under runs/ against every work's answer key; say what was found."""
    t0 = time.monotonic()
    human = {name: episodes for name, work in works.items()
             if (episodes := work.read_all_human())}
    indexes = [leakguard.index_for(name, episodes) for name, episodes in human.items()]
    # The keys and how text is read: a file clean under older reading rules is read again.
    keys_digest = dataset.sha256_text(f"textnorm {textnorm.VERSION}\n" + "".join(
        f"{name}:{dataset.episodes_digest(eps)}\n" for name, eps in human.items()))
    cache_path = runs / layout.STATE_DIR / CACHE
    old = _read_cache(cache_path, keys_digest)
    new: dict[str, list[int]] = {}

    def unchanged(path: Path) -> bool:
        try:
            st = os.lstat(path)
        except OSError:
            return False
        new[str(path)] = [st.st_size, st.st_mtime_ns, st.st_ino]
        return old.get(str(path)) == new[str(path)]

    result = audit.scan(runs, indexes, unchanged=unchanged, data_root=data_root,
                        copies=audit.human_copies(human))
    for link in result.links:
        emit("audit.link", level="error", file=str(link.file), target=str(link.target))
    for error in result.errors:
        # "<path>: why": a file that could not be read is not clean.
        for path in [p for p in new if error.startswith(f"{p}: ")]:
            del new[path]
    for hit in result.hits:
        new.pop(str(hit.file), None)  # never remembered as clean
        emit("audit.leak", level="error", file=str(hit.file), line=hit.line,
             work=hit.work, episode=hit.episode, n_words=hit.n_words)
    new.pop(str(cache_path), None)
    with contextlib.suppress(OSError):
        sealed_write.write_text(cache_path, json.dumps({"keys": keys_digest, "files": new}))
    emit("audit.completed", level="warning" if result.hits or result.links else "info",
         files=result.files, skipped=result.skipped, leaks=len(result.hits),
         links=len(result.links), errors=len(result.errors),
         duration_ms=int((time.monotonic() - t0) * 1000))


def _read_cache(path: Path, keys_digest: str) -> dict[str, list[int]]:
    """Signatures of files found clean against these answer keys ({} if none)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("keys") != keys_digest:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}
