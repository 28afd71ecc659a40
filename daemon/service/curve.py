"""The loss curve as it is on disk: one row per reported step of a run.

A step is reported when its marker (runs/<run>/loss/.steps/epoch_EE-step_SS.json)
says so; its numbers are those of the sidecars beside its reports, so a row
is what is on disk now, whether the daemon runs or not. `skilltrain
progress` prints these rows; the step.reported event takes its craft
distance fields from here, and the loop its stop rules' distances.
"""
from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import layout


@dataclass(frozen=True)
class StepRow:
    """One reported step of a run, summed over its sidecars."""

    run: str
    epoch: int
    step: int
    sets: int  # sidecars found beside the step's reports
    craft_distance: float | None  # mean over the sets that have one
    craft_distance_change: float | None  # against the run's previous reported step
    # Of the step's checked claims (docs/grounded-reports.md), the share the
    # measurements contradict; None: no claim of the step could be checked.
    claims_contradicted_share: float | None
    claims_unchecked: int  # sets whose report had no readable claims list
    tokens_in: int
    tokens_out: int
    tokens_cached: int
    tokens_cache_write: int
    cost_usd: float | None  # None: no set of the step could be priced


# ------------------------------------------------------------------ reading


def reported_steps(runs: Path, run: str) -> list[tuple[int, int]]:
    """(epoch, step) of every reported step of the run, in order."""
    markers = layout.markers_dir(runs, run)
    return [at for at, name in _marked_steps(markers) if _is_reported(markers / name)]


def _marked_steps(markers: Path) -> list[tuple[tuple[int, int], str]]:
    """((epoch, step), marker file name) of every step marker, in order; none read."""
    try:
        names = os.listdir(markers)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    return sorted((at, name) for name in names if (at := _marker_step(name)) is not None)


@functools.lru_cache(maxsize=16384)
def _marker_step(name: str) -> tuple[int, int] | None:
    """(epoch, step) of a marker's file name, else None. Cached: every step
    reported lists the run's markers, and the names seldom change."""
    m = layout.STEP_MARKER_NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _previous_reported(runs: Path, step: layout.StepKey) -> tuple[int, int] | None:
    """The last reported step before `step`: the step just before when it is
    reported (the common case: one marker read), else the markers read newest
    first, up to the first reported one. Listing them for every step.reported
    was linear in the run's steps (1.1 ms a step at ~500 steps; reading them
    all, 20,000 reads for 200 steps at a cold start)."""
    if step.step > 0:
        before = layout.StepKey(step.run, step.epoch, step.step - 1)
        if _is_reported(before.marker(runs)):
            return before.epoch, before.step
    markers = layout.markers_dir(runs, step.run)
    for at, name in reversed(_marked_steps(markers)):
        if at < (step.epoch, step.step) and _is_reported(markers / name):
            return at
    return None


def _is_reported(marker: Path) -> bool:
    data = _read_json(marker)
    return data is not None and data.get("reported_at") is not None


def read_step_marker(runs: Path, step: layout.StepKey) -> dict[str, Any]:
    """The step's marker ({} when it has none): `reported_at`, `optimizer_done`, ..."""
    return _read_json(step.marker(runs)) or {}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def step_sidecars(reports_dir: Path) -> list[dict[str, Any]]:
    """The sidecars of one step's reports (each report's `<stem>.json`)."""
    try:
        entries = list(os.scandir(reports_dir))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    names = {e.name for e in entries}
    out = []
    for name in sorted(names):
        # A sidecar sits beside its report: `x.json` next to `x.md`.
        if name.endswith(".json") and f"{name[:-5]}.md" in names:
            data = _read_json(reports_dir / name)
            if data is not None and "schema" in data:
                out.append(data)
    return out


def summarize(run: str, epoch: int, step: int, sidecars: Sequence[dict[str, Any]],
              previous: float | None) -> StepRow:
    distances = _numbers(sidecars, "craft_distance")
    costs = _numbers(sidecars, "cost_usd")
    mean = math.fsum(distances) / len(distances) if distances else None
    change = mean - previous if mean is not None and previous is not None else None
    return StepRow(
        run=run, epoch=epoch, step=step, sets=len(sidecars),
        craft_distance=_round(mean), craft_distance_change=_round(change),
        **_claims(sidecars),
        tokens_in=_sum(sidecars, "tokens_in"), tokens_out=_sum(sidecars, "tokens_out"),
        tokens_cached=_sum(sidecars, "tokens_cached"),
        tokens_cache_write=_sum(sidecars, "tokens_cache_write"),
        cost_usd=_round(math.fsum(costs)) if costs else None,
    )


def run_rows(runs: Path, run: str) -> list[StepRow]:
    """Every reported step of one run, with the change of each against the one before."""
    rows: list[StepRow] = []
    previous: float | None = None
    for epoch, step in reported_steps(runs, run):
        reports = layout.StepKey(run, epoch, step).reports_dir(runs)
        row = summarize(run, epoch, step, step_sidecars(reports), previous)
        rows.append(row)
        previous = row.craft_distance
    return rows


def collect(runs: Path, run: str | None = None) -> list[StepRow]:
    """The rows of one run, or of every run under runs/ (sorted by name)."""
    names = [run] if run is not None else _run_names(runs)
    return [row for name in names for row in run_rows(runs, name)]


def _run_names(runs: Path) -> list[str]:
    return [run.name for run in layout.run_dirs(runs)]


def step_fields(runs: Path, step: layout.StepKey) -> dict[str, Any]:
    """`craft_distance` and `craft_distance_change` for the step.reported event."""
    earlier = _previous_reported(runs, step)
    previous = None
    if earlier:
        previous = _step_distance(layout.StepKey(step.run, *earlier).reports_dir(runs))
    row = summarize(step.run, step.epoch, step.step,
                    step_sidecars(step.reports_dir(runs)), previous)
    _remember_distance(step.reports_dir(runs), row.craft_distance)
    return {"craft_distance": row.craft_distance,
            "craft_distance_change": row.craft_distance_change,
            "claims_contradicted_share": row.claims_contradicted_share}


def _claims(sidecars: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The step's contradicted share (pooled over its sets' checked claims)."""
    blocks = [c for s in sidecars if isinstance(c := s.get("claims"), dict)]
    contradicted = _sum(blocks, "contradicted")
    checked = contradicted + _sum(blocks, "confirmed")
    return {"claims_contradicted_share": _round(contradicted / checked) if checked else None,
            "claims_unchecked": sum(b.get("status") in ("not_checked", "malformed")
                                    for b in blocks)}


# reports folder -> (its (inode, mtime_ns) when read, the mean craft distance).
# Each step.reported needs the step before's mean: a scan reporting a whole
# run step by step would read every sidecar twice. A report lands by rename,
# which moves the folder's mtime, so an unchanged stamp is an unchanged mean.
_RACY_NS = 2_000_000_000  # a stamp this fresh may hide a second change in its tick
_MAX_REMEMBERED = 4096
_distances: dict[Path, tuple[tuple[int, int], float | None]] = {}


def _folder_stamp(folder: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(folder)
    except OSError:
        return None
    if time.time_ns() - st.st_mtime_ns < _RACY_NS:
        return None
    return st.st_ino, st.st_mtime_ns


def _step_distance(reports_dir: Path) -> float | None:
    stamp = _folder_stamp(reports_dir)
    known = _distances.get(reports_dir)
    if stamp is not None and known is not None and known[0] == stamp:
        return known[1]
    distance = summarize("", 0, 0, step_sidecars(reports_dir), None).craft_distance
    _remember_distance(reports_dir, distance, stamp)
    return distance


def _remember_distance(reports_dir: Path, distance: float | None,
                       stamp: tuple[int, int] | None = None) -> None:
    stamp = stamp or _folder_stamp(reports_dir)
    if stamp is None:
        return
    if len(_distances) >= _MAX_REMEMBERED:
        _distances.clear()
    _distances[reports_dir] = (stamp, distance)


def _numbers(sidecars: Sequence[dict[str, Any]], key: str) -> list[float]:
    """The finite numbers the sidecars hold under `key` (null, absent or junk: skipped)."""
    values = (s.get(key) for s in sidecars)
    return [float(v) for v in values
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]


def _sum(sidecars: Sequence[dict[str, Any]], key: str) -> int:
    return sum(v for s in sidecars if isinstance(v := s.get(key), int) and not isinstance(v, bool))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
