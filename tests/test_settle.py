"""When a complete range counts as finished being written (daemon/service/settle.py):
quiet for [loss] settle_s by its mtimes and by what the daemon saw change,
at once with a fresh _SUCCESS, from the daemon's own clock when the writer's
runs ahead. Observations made by hand, a clock the test sets; no files."""

from __future__ import annotations

from pathlib import Path

from skilltrain.daemon.core import layout
from skilltrain.daemon.service.observe import FileSig, Observation
from skilltrain.daemon.service.settle import CLOCK_SKEW_TOLERANCE_S, SettleClock

KEY = layout.SetKey("r1", 1, 1, "alpha", 1, 3)
SETTLE_S = 30.0
NOW = 1_000_000.0


def seen(size: int = 10, *, mtime: float = NOW - 3600, success: bool = False) -> Observation:
    sig = FileSig(size=size, mtime_ns=int(mtime * 1e9), ino=1, ctime_ns=int(mtime * 1e9))
    return Observation(KEY, ((1, sig),), None, success, int(mtime * 1e9))


class Notices:
    def __init__(self) -> None:
        self.said: list[tuple[str, str]] = []

    def __call__(self, path: Path, reason: str, event: str) -> bool:
        self.said.append((event, reason))
        return True


def clock() -> tuple[SettleClock, Notices]:
    notices = Notices()
    return SettleClock(SETTLE_S, Path("/runs"), notices), notices


def test_a_first_sighting_waits_even_when_the_mtimes_are_old() -> None:
    settle, _ = clock()
    # cp -p, rsync -t: old mtimes, maybe still being appended to.
    assert settle.ready_at(KEY, seen(), NOW) == NOW + SETTLE_S
    assert settle.ready_at(KEY, seen(), NOW + 10) == NOW + SETTLE_S  # unchanged: the same wait


def test_a_change_starts_the_wait_again_from_when_it_was_seen() -> None:
    settle, _ = clock()
    settle.ready_at(KEY, seen(10), NOW)
    assert settle.ready_at(KEY, seen(20), NOW + 20) == NOW + 20 + SETTLE_S


def test_recent_mtimes_wait_for_the_files_to_be_quiet() -> None:
    settle, _ = clock()
    settle.ready_at(KEY, seen(mtime=NOW - 5), NOW - 100)  # first seen long ago
    assert settle.ready_at(KEY, seen(mtime=NOW - 5), NOW) == NOW - 5 + SETTLE_S


def test_a_fresh_success_marker_says_finished_at_once() -> None:
    settle, _ = clock()
    assert settle.ready_at(KEY, seen(success=True, mtime=NOW - 1), NOW) == 0.0
    assert settle.ready_at(KEY, seen(20, success=True, mtime=NOW), NOW) == 0.0


def test_forgetting_a_set_makes_its_next_look_a_first_sighting() -> None:
    settle, _ = clock()
    settle.ready_at(KEY, seen(), NOW)
    assert settle.ready_at(KEY, seen(), NOW + SETTLE_S) == NOW + SETTLE_S  # settled
    settle.forget(KEY)  # its inputs changed under a job
    assert settle.ready_at(KEY, seen(), NOW + SETTLE_S) == NOW + 2 * SETTLE_S


def test_a_writer_clock_ahead_of_ours_settles_from_our_clock_and_is_said() -> None:
    settle, notices = clock()
    ahead = NOW + CLOCK_SKEW_TOLERANCE_S + 600
    assert settle.ready_at(KEY, seen(mtime=ahead), NOW) == NOW + SETTLE_S  # not ahead + 30
    assert [event for event, _ in notices.said] == ["set.clock_skew"]
    jitter = NOW + CLOCK_SKEW_TOLERANCE_S - 0.5  # normal jitter: the mtimes count
    settle2, notices2 = clock()
    assert settle2.ready_at(KEY, seen(mtime=jitter), NOW) == jitter + SETTLE_S
    assert notices2.said == []
