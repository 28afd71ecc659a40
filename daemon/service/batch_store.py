"""A provider batch's durable record: which sets it carries, from which inputs.

    runs/<run>/loss/.batches/<key>.json    one per batch not yet closed

Written atomically *before* the daemon relies on it: first as
"submitting" (our own key, the sets, their input hashes) before any byte
goes to the provider, then "open" with the provider's batch id. A daemon
killed between the two finds the batch again by the key it sent as
metadata (batch.py's recovery), so it never pays twice; a restart reads
these files and resumes polling, and never sends a set one of them
carries. They live beside the reports, not in the state database (a cache
that may be lost). They hold names, hashes, ids and counts only: nothing
from data/, and no provider text (that goes through the guard into the log).
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core import atomic, layout
from ..guard import sealed_write

SCHEMA = 1
SUBMITTING, OPEN, CANCELLING = "submitting", "open", "cancelling"


@dataclass
class BatchItem:
    """One set in a batch: the request's custom_id and what it was made from."""

    custom_id: str
    set_id: str
    inputs: dict[str, str]  # loss.InputHashes.as_dict() when sent
    fingerprint: dict[str, Any]  # observe.Fingerprint.as_json() when queued
    attempts: int = 0  # failed attempts before this one (jobs' retry count)
    outcome: str | None = None  # None: no result handled yet; else the set's state after it
    # Handed to a worker in this process (its end records the outcome); read
    # back as False: a result a restart cut short is handled again.
    dispatched: bool = False


@dataclass
class BatchRecord:
    key: str  # ours, sent as metadata skilltrain_key: how a lost batch id is found again
    run: str
    step: str  # layout.StepKey.id
    model: str
    state: str = SUBMITTING
    batch_id: str | None = None
    items: list[BatchItem] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    submitted_at: float | None = None
    provider_status: str | None = None
    counts: dict[str, int] = field(default_factory=dict)  # the provider's request_counts
    return_live: bool = False  # cancelled by the user asking for its sets live
    # Why the provider did not take the create (guarded text), kept so that a
    # restart counts it as a refusal and not as a daemon killed before its create.
    create_error: str | None = None

    def waiting(self) -> list[BatchItem]:
        """Items whose result is not handled yet."""
        return [item for item in self.items if item.outcome is None]

    def as_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, data: Any) -> BatchRecord | None:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            return None
        try:
            items = [BatchItem(**{**item, "dispatched": False}) for item in data["items"]]
            fields = {k: v for k, v in data.items() if k not in ("schema", "items")}
            return cls(items=items, **fields)
        except (KeyError, TypeError):
            return None


def batches_dir(runs: Path, run: str) -> Path:
    return runs / run / layout.LOSS_DIR / layout.BATCHES_DIR


def record_path(runs: Path, rec: BatchRecord) -> Path:
    return batches_dir(runs, rec.run) / f"{rec.key}.json"


def save(runs: Path, rec: BatchRecord) -> None:
    """Durable when it returns (fsync of the file and of its folder)."""
    sealed_write.write_text(record_path(runs, rec), json.dumps(rec.as_json(), indent=1) + "\n")


def remove(runs: Path, rec: BatchRecord) -> None:
    """The batch is closed: every item handled."""
    with contextlib.suppress(FileNotFoundError):
        record_path(runs, rec).unlink()
    atomic.fsync_dir(batches_dir(runs, rec.run))


def load_all(runs: Path) -> tuple[list[BatchRecord], list[Path]]:
    """Every record under runs/*/loss/.batches/, and the files that are not one."""
    records: list[BatchRecord] = []
    bad: list[Path] = []
    for run in layout.run_dirs(runs):
        folder = batches_dir(runs, run.name)
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.json")):
            try:
                rec = BatchRecord.from_json(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                rec = None
            if rec is None or rec.run != run.name:
                bad.append(path)
            else:
                records.append(rec)
    return records, bad


def open_batches(runs: Path, run: str | None = None) -> list[dict[str, Any]]:
    """For `skilltrain status`: each open batch as a row (reads only these files)."""
    now = time.time()
    rows = []
    for rec in load_all(runs)[0]:
        if run is not None and rec.run != run:
            continue
        outcomes = [item.outcome for item in rec.items]
        rows.append({
            "run": rec.run, "step": rec.step, "key": rec.key, "batch_id": rec.batch_id,
            "state": rec.state, "provider_status": rec.provider_status,
            "sets": len(rec.items),
            "submitted_ago_s": None if rec.submitted_at is None
            else round(now - rec.submitted_at, 1),
            "done": sum(1 for o in outcomes if o == "done"),
            "failed": sum(1 for o in outcomes if o not in (None, "done")),
            "provider_completed": rec.counts.get("completed", 0),
            "provider_failed": rec.counts.get("failed", 0),
        })
    return rows
