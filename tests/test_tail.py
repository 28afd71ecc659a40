"""`skilltrain tail`: readable lines, tally, filters, --follow through rotation."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.commands.tail import TALLY_EVERY, main
from skilltrain.daemon.infra import log as slog

CTX: dict[str, Any] = {"run": "r7", "epoch": 1, "step": 2}


def at(second: int) -> str:
    return f"2026-05-04T09:12:{second:02d}.120431Z"


def clock(second: int) -> str:
    # tail shows local time, like journalctl.
    return datetime.fromisoformat(at(second)).astimezone().strftime("%H:%M:%S")


def ev(second: int, event: str, level: str = "info", **fields: Any) -> str:
    return json.dumps({"timestamp": at(second), "level": level, "event": event, **fields}) + "\n"


def sample() -> list[str]:
    alice = {**CTX, "work": "alice", "range": "01-03"}
    bob = {**CTX, "work": "bob", "range": "01-03"}
    bob2 = {**CTX, "work": "bob", "range": "04-06"}
    return [
        ev(
            0,
            "daemon.started",
            pid=4242,
            version="0.1.0",
            config="/etc/st.toml",
            runs_dir="/srv/runs",
            observer="native",
            concurrency=2,
        ),
        ev(
            1,
            "scan.completed",
            sets=3,
            ready=3,
            done=0,
            stale=0,
            failed=0,
            waiting=0,
            duration_ms=12,
        ),
        ev(2, "daemon.ready"),
        ev(3, "set.ready", **alice),
        ev(4, "loss.queued", **alice, job_id="j-a"),
        ev(4, "loss.queued", **bob, job_id="j-b"),
        ev(4, "loss.queued", **bob2, job_id="j-b2"),
        ev(5, "loss.started", **alice, job_id="j-a", prompt_chars=52311, prompt_tokens=13012),
        ev(6, "loss.retry", "warning", **alice, attempt=1, wait_s=4.0, error="RateLimitError: 429"),
        ev(
            7,
            "loss.completed",
            **alice,
            report="runs/r7/loss/epoch_01/step_02/alice_ep01-03.md",
            tokens_in=18211,
            tokens_out=1034,
            tokens_cached=0,
            cost_usd=0.0123,
            duration_ms=41230,
            leaks_redacted=0,
        ),
        ev(8, "loss.refused", "warning", **bob2, reason="ep05.txt is empty"),
        ev(
            9,
            "loss.failed",
            "error",
            **bob,
            reason="LLMError: timeout",
            attempts=3,
            next_retry_s=300.0,
        ),
        ev(10, "step.reported", **CTX, reports_dir="runs/r7/loss/epoch_01/step_02", sets=3),
        ev(11, "optimizer.started", **CTX, argv=["python", "opt.py", "--note", "a b"]),
        ev(12, "optimizer.output", **CTX, stream="stderr", line="3 reports read"),
        ev(13, "optimizer.finished", "error", **CTX, exit_code=2, duration_ms=12345),
        ev(
            14,
            "loss.completed",
            run="r8",
            epoch=1,
            step=1,
            work="carol",
            range="01-02",
            tokens_in=100,
            tokens_out=10,
            tokens_cached=5,
            cost_usd=0.001,
            duration_ms=900,
            leaks_redacted=2,
        ),
        ev(15, "daemon.stopped", exit_code=0, done=2, failed=1, abandoned=0),
    ]


def run_tail(path: Path, **kwargs: Any) -> tuple[int, list[str]]:
    out = io.StringIO()
    opts: dict[str, Any] = {"follow": False, "run": None, "event": None} | kwargs
    code = main(path, out=out, **opts)
    return code, out.getvalue().splitlines()


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    path = tmp_path / "skilltrain.log"
    path.write_text("".join(sample()), encoding="utf-8")
    return path


def test_one_readable_line_per_event_and_a_final_tally(log_path: Path) -> None:
    code, lines = run_tail(log_path)
    assert code == 0
    w = 24
    expected = [
        f"{clock(0)}   {'daemon.started':<18}  {'':<{w}}  pid=4242 version=0.1.0 "
        "config=/etc/st.toml runs_dir=/srv/runs observer=native concurrency=2",
        f"{clock(1)}   {'scan.completed':<18}  {'':<{w}}  sets=3 ready=3 done=0 stale=0 "
        "failed=0 waiting=0 12ms",
        f"{clock(2)}   daemon.ready",
        f"{clock(3)}   {'set.ready':<18}  r7/e01/s02 alice r01-03",
        f"{clock(4)}   {'loss.queued':<18}  r7/e01/s02 alice r01-03",
        f"{clock(4)}   {'loss.queued':<18}  r7/e01/s02 bob r01-03",
        f"{clock(4)}   {'loss.queued':<18}  r7/e01/s02 bob r04-06",
        f"{clock(5)}   {'loss.started':<18}  {'r7/e01/s02 alice r01-03':<{w}}  "
        "prompt=52311ch/13012tok",
        f"{clock(6)} W {'loss.retry':<18}  {'r7/e01/s02 alice r01-03':<{w}}  "
        'attempt=1 wait=4.0s error="RateLimitError: 429"',
        f"{clock(7)}   {'loss.completed':<18}  {'r7/e01/s02 alice r01-03':<{w}}  "
        "in=18211 out=1034 cached=0 $0.0123 41.2s",
        f"{clock(8)} W {'loss.refused':<18}  {'r7/e01/s02 bob r04-06':<{w}}  "
        'reason="ep05.txt is empty"',
        f"{clock(9)} E {'loss.failed':<18}  {'r7/e01/s02 bob r01-03':<{w}}  "
        'reason="LLMError: timeout" attempts=3 retry in 5m00s',
        f"{clock(10)}   {'step.reported':<18}  {'r7/e01/s02':<{w}}  "
        "sets=3 reports=runs/r7/loss/epoch_01/step_02",
        "== r7/e01/s02  done 1  running 0  queued 0  failed 1  refused 1"
        "  | step in=18211 out=1034 cached=0 $0.0123",
        f"{clock(11)}   {'optimizer.started':<18}  {'r7/e01/s02':<{w}}  "
        "$ python opt.py --note 'a b'",
        f"{clock(12)}   {'optimizer.output':<18}  {'r7/e01/s02':<{w}}  stderr| 3 reports read",
        f"{clock(13)} E {'optimizer.finished':<18}  {'r7/e01/s02':<{w}}  exit=2 12.3s",
        f"{clock(14)}   {'loss.completed':<18}  {'r8/e01/s01 carol r01-02':<{w}}  "
        "in=100 out=10 cached=5 $0.0010 900ms leaks_redacted=2",
        f"{clock(15)}   {'daemon.stopped':<18}  {'':<{w}}  exit_code=0 done=2 failed=1 abandoned=0",
        "== summary",
        "== r7/e01/s02  done 1  running 0  queued 0  failed 1  refused 1"
        "  | step in=18211 out=1034 cached=0 $0.0123",
        "== r8/e01/s01  done 1  running 0  queued 0  failed 0"
        "  | step in=100 out=10 cached=5 $0.0010",
        "== r7  in=18211 out=1034 cached=0 $0.0123",
        "== r8  in=100 out=10 cached=5 $0.0010",
    ]
    assert lines == expected


def test_tally_follows_each_set_to_its_last_state(tmp_path: Path) -> None:
    path = tmp_path / "log"
    a = {**CTX, "work": "a", "range": "01-03"}
    lines = [
        ev(0, "loss.queued", **a),
        ev(1, "loss.started", **a),
        ev(2, "loss.failed", "error", **a, reason="x", attempts=3, next_retry_s=None),
        ev(3, "loss.queued", **{**a, "range": "04-06"}),
        ev(4, "loss.started", **a),  # the retry of the failed set
        ev(5, "cost.total", run="r7", tokens_in=500, tokens_out=50, cost_usd=0.5),
    ]
    path.write_text("".join(lines))
    code, out = run_tail(path)
    assert code == 0
    assert "no retry" in out[2]
    # No report was completed in this log: the step cost nothing here; the
    # run's total is the daemon's own (cost.total).
    assert out[-2:] == [
        "== r7/e01/s02  done 0  running 1  queued 1  failed 0",
        "== r7  in=500 out=50 cached=0 $0.5000",
    ]


def test_each_step_says_what_it_cost_and_each_run_its_total_once(tmp_path: Path) -> None:
    def done(step: int, work: str, tokens_in: int, cost: float, run: str = "r7") -> str:
        return ev(step, "loss.completed", run=run, epoch=0, step=step, work=work,
                  range="01-03", tokens_in=tokens_in, tokens_out=tokens_in // 10,
                  tokens_cached=0, cost_usd=cost, duration_ms=1)

    path = tmp_path / "log"
    path.write_text("".join([
        done(0, "a", 1000, 0.10), done(0, "b", 2000, 0.20),
        done(1, "a", 4000, 0.40),
        done(2, "a", 8000, 0.80), done(2, "a", 100, 0.01),  # the same set redone: both paid
        done(0, "a", 5, 0.005, run="r8"),
    ]))
    _, out = run_tail(path)
    summary = out[out.index("== summary") + 1:]
    states = "running 0  queued 0  failed 0  | step"
    assert summary == [
        f"== r7/e00/s00  done 2  {states} in=3000 out=300 cached=0 $0.3000",
        f"== r7/e00/s01  done 1  {states} in=4000 out=400 cached=0 $0.4000",
        f"== r7/e00/s02  done 1  {states} in=8100 out=810 cached=0 $0.8100",
        f"== r8/e00/s00  done 1  {states} in=5 out=0 cached=0 $0.0050",
        "== r7  in=15100 out=1510 cached=0 $1.5100",
        "== r8  in=5 out=0 cached=0 $0.0050",
    ]
    # Each run's total once, and only on its own line.
    assert sum("$1.5100" in line for line in out) == 1


def test_a_tally_line_every_n_finished_jobs(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_text(
        "".join(
            ev(
                i % 60,
                "loss.completed",
                **CTX,
                work="w",
                range=f"{i:02d}-{i:02d}",
                tokens_in=1,
                tokens_out=1,
                tokens_cached=0,
                cost_usd=0.0,
                duration_ms=1,
            )
            for i in range(1, 2 * TALLY_EVERY + 1)
        )
    )
    _, out = run_tail(path)
    tallies = [i for i, line in enumerate(out) if line.startswith("== r7/e01/s02")]
    assert tallies[:2] == [TALLY_EVERY, 2 * TALLY_EVERY + 1]
    assert out[TALLY_EVERY].startswith(f"== r7/e01/s02  done {TALLY_EVERY}  ")


@pytest.mark.parametrize(
    ("spec", "events"),
    [
        (
            "loss",
            ["loss.queued"] * 3
            + [
                "loss.started",
                "loss.retry",
                "loss.completed",
                "loss.refused",
                "loss.failed",
                "loss.completed",
            ],
        ),
        (
            "loss.",
            ["loss.queued"] * 3
            + [
                "loss.started",
                "loss.retry",
                "loss.completed",
                "loss.refused",
                "loss.failed",
                "loss.completed",
            ],
        ),
        ("loss.completed", ["loss.completed", "loss.completed"]),
        (
            "loss.failed,optimizer",
            ["loss.failed", "optimizer.started", "optimizer.output", "optimizer.finished"],
        ),
        ("los", []),
        ("daemon.ready", ["daemon.ready"]),
    ],
)
def test_event_filter_by_name_or_prefix(log_path: Path, spec: str, events: list[str]) -> None:
    _, out = run_tail(log_path, event=spec)
    shown = [
        line.split()[2] if line[9] != " " else line.split()[1]
        for line in out
        if not line.startswith("==")
    ]
    assert shown == events
    # No periodic tally with --event; the final summary stays.
    assert out[len(events)] == "== summary" and out.count("== summary") == 1


def test_run_filter(log_path: Path) -> None:
    _, out = run_tail(log_path, run="r8")
    assert [line for line in out if not line.startswith("==")] == [
        f"{clock(14)}   {'loss.completed':<18}  {'r8/e01/s01 carol r01-02':<24}  "
        "in=100 out=10 cached=5 $0.0010 900ms leaks_redacted=2"
    ]
    assert out[-2:] == [
        "== r8/e01/s01  done 1  running 0  queued 0  failed 0"
        "  | step in=100 out=10 cached=5 $0.0010",
        "== r8  in=100 out=10 cached=5 $0.0010",
    ]
    _, nothing = run_tail(log_path, run="nope")
    assert nothing == []


def test_non_json_lines_are_counted_and_a_partial_last_line_is_held(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_text(
        "Traceback (most recent call last):\n"
        + ev(1, "daemon.ready")
        + "[1, 2]\n"
        + '{"no": "event"}\n'
        + "\n"
        + ev(2, "daemon.stopping", reason="SIGTERM", running=0, queued=0)
        + ev(3, "daemon.stopped", exit_code=0)[:40]  # a writer mid-line
    )
    _, out = run_tail(path)
    assert [line.split()[1] for line in out[:2]] == ["daemon.ready", "daemon.stopping"]
    assert out[2:] == [
        "== skipped 3 line(s) that are not JSON events",
        "== 1 incomplete line(s) at the end not shown",
    ]


def test_exception_and_foreign_lines(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_text(
        ev(
            1,
            "loss.failed",
            "error",
            **CTX,
            work="a",
            range="01-01",
            reason="unexpected",
            attempts=1,
            next_retry_s=60,
            exception=[{"exc_type": "KeyError", "exc_value": "'x'", "frames": []}],
        )
        + ev(2, "HTTP Request: POST http://127.0.0.1:8000/v1 429", "warning", logger="httpx")
    )
    _, out = run_tail(path)
    assert out[0].endswith("attempts=1 retry in 1m00s [KeyError: 'x']")
    assert out[1] == f"{clock(2)} W HTTP Request: POST http://127.0.0.1:8000/v1 429"


def test_control_characters_and_long_text_are_tamed(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_text(
        ev(1, "optimizer.output", **CTX, stream="stdout", line="\x1b[2Jwiped\rscreen")
        + ev(2, "loss.refused", **CTX, work="a", range="01-01", reason="é" + "x" * 500)
    )
    _, out = run_tail(path)
    assert "\x1b" not in out[0] and out[0].endswith("stdout| \\x1b[2Jwiped\\rscreen")
    assert "reason=éxxx" in out[1] and out[1].endswith("x...") and len(out[1]) < 300


def test_missing_file_without_follow_is_an_error(tmp_path: Path) -> None:
    err = io.StringIO()
    assert (
        main(
            tmp_path / "absent.log", follow=False, run=None, event=None, out=io.StringIO(), err=err
        )
        == 1
    )
    assert "absent.log" in err.getvalue()


# ----------------------------------------------------------------------------- follow


class Follow:
    """`main(follow=True)` in a thread; stopped and joined at the end."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        self.out = io.StringIO()
        self.stop = threading.Event()
        self.code: int | None = None
        opts: dict[str, Any] = {"run": None, "event": None} | kwargs

        def target() -> None:
            self.code = main(
                path,
                follow=True,
                out=self.out,
                stop=self.stop,
                poll_s=0.02,
                err=io.StringIO(),
                **opts,
            )

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def lines(self) -> list[str]:
        return self.out.getvalue().splitlines()

    def events(self) -> list[str]:
        return [line.split()[1] for line in self.lines() if not line.startswith("==")]

    def wait_for(self, check: Callable[[list[str]], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check(self.events()):
                return
            time.sleep(0.01)
        raise AssertionError(f"timed out; output so far: {self.lines()}")

    def finish(self) -> list[str]:
        self.stop.set()
        self.thread.join(timeout=5)
        assert not self.thread.is_alive()
        assert self.code == 0
        return self.lines()


@pytest.fixture
def follower() -> Iterator[list[Follow]]:
    started: list[Follow] = []
    yield started
    for f in started:
        f.stop.set()
        f.thread.join(timeout=5)


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def test_follow_waits_for_the_file_and_picks_up_appended_lines(
    tmp_path: Path, follower: list[Follow]
) -> None:
    path = tmp_path / "late" / "skilltrain.log"
    f = Follow(path)
    follower.append(f)
    time.sleep(0.1)  # several polls with no file
    assert f.lines() == []
    path.parent.mkdir()
    append(path, ev(1, "daemon.started", pid=1) + ev(2, "daemon.ready"))
    f.wait_for(lambda e: e == ["daemon.started", "daemon.ready"])

    partial = ev(3, "scan.completed", sets=0, duration_ms=5)
    append(path, partial[:25])
    time.sleep(0.15)  # several polls: the half line must not be printed
    assert f.events() == ["daemon.started", "daemon.ready"]
    append(path, partial[25:])
    f.wait_for(lambda e: e[-1:] == ["scan.completed"])
    lines = f.finish()
    # No loss events: no tally; nothing skipped, nothing left half-read.
    assert len(lines) == 3
    assert f.events() == ["daemon.started", "daemon.ready", "scan.completed"]


def test_follow_survives_rename_rotation(tmp_path: Path, follower: list[Follow]) -> None:
    path = tmp_path / "skilltrain.log"
    append(path, ev(1, "loss.queued", **CTX, work="a", range="01-01"))
    f = Follow(path)
    follower.append(f)
    f.wait_for(lambda e: e == ["loss.queued"])

    # logrotate renames; the writer finishes a line in the old file (its open
    # descriptor) before it notices and creates the new file.
    with open(path, "a", encoding="utf-8") as old:
        os.rename(path, tmp_path / "skilltrain.log.1")
        time.sleep(0.1)  # the follower polls a path that does not exist
        old.write(ev(2, "loss.started", **CTX, work="a", range="01-01"))
        old.flush()
        time.sleep(0.1)
        append(
            path,
            ev(
                3,
                "loss.completed",
                **CTX,
                work="a",
                range="01-01",
                tokens_in=7,
                tokens_out=3,
                tokens_cached=0,
                cost_usd=0.5,
                duration_ms=10,
            ),
        )
    f.wait_for(lambda e: e[-1:] == ["loss.completed"])
    append(path, ev(4, "step.reported", **CTX, sets=1, reports_dir="d"))
    f.wait_for(lambda e: e[-1:] == ["step.reported"])
    lines = f.finish()
    assert f.events() == ["loss.queued", "loss.started", "loss.completed", "step.reported"]
    assert lines[-2:] == [
        "== r7/e01/s02  done 1  running 0  queued 0  failed 0  | step in=7 out=3 cached=0 $0.5000",
        "== r7  in=7 out=3 cached=0 $0.5000",
    ]


def test_follow_starts_over_after_copytruncate(tmp_path: Path, follower: list[Follow]) -> None:
    path = tmp_path / "skilltrain.log"
    append(path, ev(1, "daemon.started", pid=1) + ev(2, "daemon.ready"))
    f = Follow(path)
    follower.append(f)
    f.wait_for(lambda e: e == ["daemon.started", "daemon.ready"])
    with open(path, "r+", encoding="utf-8") as fh:
        fh.truncate(0)
    time.sleep(0.1)
    append(path, ev(3, "scan.completed", sets=0, duration_ms=1))
    f.wait_for(lambda e: e[-1:] == ["scan.completed"])
    f.finish()
    assert f.events() == ["daemon.started", "daemon.ready", "scan.completed"]


def test_follow_reads_what_the_real_logger_writes_across_rotation(
    tmp_path: Path, follower: list[Follow]
) -> None:
    path = tmp_path / "logs" / "skilltrain.log"
    slog.configure(log_file=path, stderr=io.StringIO())
    try:
        logger = slog.get_logger("skilltrain.test")
        f = Follow(path, event="loss")
        follower.append(f)
        with slog.bound_job(run="r1", epoch=2, step=3, work="w", range=(4, 6)):
            logger.info("loss.queued", job_id="j")
            f.wait_for(lambda e: e == ["loss.queued"])
            os.rename(path, path.with_name("skilltrain.log.1"))
            logger.info(
                "loss.completed",
                tokens_in=1,
                tokens_out=2,
                tokens_cached=0,
                cost_usd=0.25,
                duration_ms=1500,
                leaks_redacted=0,
            )
        f.wait_for(lambda e: e == ["loss.queued", "loss.completed"])
        lines = f.finish()
    finally:
        slog.shutdown()
    assert " r1/e02/s03 w r04-06 " in lines[1]
    assert lines[1].endswith("in=1 out=2 cached=0 $0.2500 1.5s")


def test_tail_does_not_import_litellm() -> None:
    code = (
        "import sys, skilltrain.daemon.commands.tail\n"
        "assert 'litellm' not in sys.modules, 'tail imported litellm'\n"
        "assert 'structlog' not in sys.modules, 'tail imported structlog'\n"
        "import skilltrain.daemon.infra.log\n"
        "assert 'litellm' not in sys.modules, 'log imported litellm'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_run_total_keeps_cache_writes_like_the_state_does() -> None:
    """The tally's spend is the state's RunSpend: cache writes (Anthropic) are not dropped."""
    from skilltrain.daemon.commands.tail_tally import Tally

    tally = Tally()
    tally.update({"event": "cost.total", "run": "r1", "tokens_in": 10, "tokens_out": 2,
                  "tokens_cached": 0, "tokens_cache_write": 40, "cost_usd": 0.5})
    assert tally.run_line("r1") == "r1  in=10 out=2 cached=0 cache_write=40 $0.5000"
