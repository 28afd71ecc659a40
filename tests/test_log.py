"""The structured log: JSON lines, context, rotation, tracebacks, secrets."""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.infra import log as slog
from skilltrain.daemon.infra.log import bound_job, configure, get_logger, scrub


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def log_file(tmp_path: Path) -> Iterator[Path]:
    # A parent that does not exist yet: configure() must create it.
    path = tmp_path / "logs" / "nested" / "skilltrain.log"
    yield path
    slog.shutdown()
    logging.getLogger().setLevel(logging.WARNING)


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_json_lines_carry_utc_timestamp_level_event_and_bound_context(log_file: Path) -> None:
    stderr = io.StringIO()
    configure(log_file=log_file, stderr=stderr)
    logger = get_logger("skilltrain.test")
    before = datetime.now(UTC)
    with bound_job(run="r7", epoch=1, step=2, work="alice", range=(1, 3), job_id="j1"):
        logger.info("loss.completed", tokens_in=18211, cost_usd=0.0123)
    logger.warning("daemon.stopping", reason="SIGTERM")

    first, second = read_lines(log_file)
    assert first["event"] == "loss.completed"
    assert first["level"] == "info"
    assert first["timestamp"].endswith("Z")
    stamp = datetime.fromisoformat(first["timestamp"])
    assert stamp.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=1) <= stamp <= datetime.now(UTC) + timedelta(seconds=1)
    assert {k: first[k] for k in ("run", "epoch", "step", "work", "range", "job_id")} == {
        "run": "r7",
        "epoch": 1,
        "step": 2,
        "work": "alice",
        "range": "01-03",
        "job_id": "j1",
    }
    assert first["tokens_in"] == 18211 and first["cost_usd"] == 0.0123
    assert list(first)[:3] == ["timestamp", "level", "event"]
    # Unbound after the block.
    assert second["level"] == "warning" and "run" not in second
    # stderr is not a TTY: the same JSON lines (journald).
    assert [json.loads(x)["event"] for x in stderr.getvalue().splitlines()] == [
        "loss.completed",
        "daemon.stopping",
    ]


def test_context_does_not_reach_worker_threads_unless_bound_there(log_file: Path) -> None:
    configure(log_file=log_file, stderr=io.StringIO())
    logger = get_logger()

    def job(tag: str, **ctx: object) -> None:
        with bound_job(**ctx):
            logger.info("loss.started", tag=tag)

    with ThreadPoolExecutor(max_workers=1) as pool:
        with bound_job(run="r1", epoch=3, step=4, work="bob", range="04-06"):
            pool.submit(job, "plain").result()
            pool.submit(job, "bound", run="r2", range=(4, 6)).result()
        pool.submit(job, "after").result()

    by_tag = {line["tag"]: line for line in read_lines(log_file)}
    # The pitfall itself: a plain thread does not inherit bind_contextvars.
    assert "run" not in by_tag["plain"]
    assert (by_tag["bound"]["run"], by_tag["bound"]["range"]) == ("r2", "04-06")
    assert "run" not in by_tag["after"]  # bound_job left nothing behind in the pool thread


def test_rename_rotation_sends_new_lines_to_the_new_file(log_file: Path) -> None:
    configure(log_file=log_file, stderr=io.StringIO())
    logger = get_logger()
    logger.info("scan.completed", n=1)
    rotated = log_file.with_name("skilltrain.log.1")
    os.rename(log_file, rotated)  # what logrotate does (without copytruncate)
    logger.info("scan.completed", n=2)
    logger.info("scan.completed", n=3)

    assert [x["n"] for x in read_lines(rotated)] == [1]
    assert [x["n"] for x in read_lines(log_file)] == [2, 3]


def test_configure_again_replaces_handlers(log_file: Path, tmp_path: Path) -> None:
    configure(log_file=log_file, stderr=io.StringIO())
    other = tmp_path / "other.log"
    stderr = io.StringIO()
    configure(log_file=other, stderr=stderr)
    configure(log_file=other, stderr=stderr)
    get_logger().info("daemon.ready")

    assert log_file.read_text() == ""
    assert [x["event"] for x in read_lines(other)] == ["daemon.ready"]
    assert len(stderr.getvalue().splitlines()) == 1


def test_traceback_has_no_locals(log_file: Path) -> None:
    tty = FakeTTY()
    configure(log_file=log_file, stderr=tty)
    screenplay = "INT. LIGHTHOUSE - NIGHT. MARGARET: You kept the letters all along."

    def call_llm(prompt: str) -> None:
        answer_key = prompt.upper()
        raise ValueError(f"provider said no ({len(answer_key)} chars)")

    try:
        call_llm(screenplay)
    except ValueError:
        get_logger().exception("loss.failed", reason="unexpected")

    text = log_file.read_text(encoding="utf-8")
    assert "MARGARET" not in text and "margaret" not in text.lower()
    assert "MARGARET" not in tty.getvalue()
    (line,) = read_lines(log_file)
    (stack,) = line["exception"]
    assert stack["exc_type"] == "ValueError"
    assert stack["exc_value"] == f"provider said no ({len(screenplay)} chars)"
    assert [f["name"] for f in stack["frames"]][-1] == "call_llm"
    assert all("locals" not in f for f in stack["frames"])
    assert "ValueError: provider said no" in tty.getvalue()


def test_exception_object_passed_as_exc_info_is_rendered_and_scrubbed(log_file: Path) -> None:
    configure(log_file=log_file, stderr=io.StringIO())
    try:
        raise ConnectionError("refused, Authorization: Bearer abcdefghijklmnop")
    except ConnectionError as exc:
        caught = exc
    # Outside the except block: only the exception object carries the traceback.
    get_logger().error("loss.failed", reason="network", exc_info=caught)
    (line,) = read_lines(log_file)
    (stack,) = line["exception"]
    assert stack["exc_type"] == "ConnectionError"
    assert stack["exc_value"] == "refused, Authorization: Bearer [redacted]"
    assert stack["frames"][0]["name"] == (
        "test_exception_object_passed_as_exc_info_is_rendered_and_scrubbed"
    )


def test_long_exception_text_is_capped(log_file: Path) -> None:
    configure(log_file=log_file, stderr=io.StringIO())
    try:
        raise RuntimeError("x" * 5000)
    except RuntimeError:
        get_logger().exception("loss.failed")
    (line,) = read_lines(log_file)
    value = line["exception"][0]["exc_value"]
    assert len(value) < 1100 and value.endswith("[4000 chars cut]")


def test_long_exception_text_is_capped_on_the_console_too(log_file: Path) -> None:
    """The console runs the JSON sink's chain (one list): the cut too."""
    tty = FakeTTY()
    configure(log_file=log_file, stderr=tty, stderr_format="console")
    try:
        raise RuntimeError("x" * 5000)
    except RuntimeError:
        get_logger().exception("loss.failed")
    assert "chars cut]" in tty.getvalue() and "x" * 1100 not in tty.getvalue()


def test_secrets_are_scrubbed_everywhere(log_file: Path, monkeypatch: pytest.MonkeyPatch,
                                         answer_keys: None) -> None:
    # A configured key with no telltale shape: only its value identifies it.
    monkeypatch.setenv("SKILLTRAIN_TEST_API_KEY", "plainlookingvalue42")
    tty = FakeTTY()
    configure(log_file=log_file, stderr=tty)
    logger = get_logger()
    secrets = [
        "plainlookingvalue42",
        "sk-ant-api03-AbCdEfGhIjKlMnOpQrStUv",
        "sk-proj-0123456789abcdefghij",
        "AKIAIOSFODNN7EXAMPLE",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJl",
        "d41d8cd98f00b204e9800998ecf8427e",
        "opaque-bearer-value-77",
        "field-value-not-a-pattern",
    ]
    logger.info(
        "loss.retry",
        error="AuthenticationError: bad key plainlookingvalue42"
        " for sk-ant-api03-AbCdEfGhIjKlMnOpQrStUv",
        url="https://api.example/v1?key=d41d8cd98f00b204e9800998ecf8427e",
        headers={"Authorization": "Bearer opaque-bearer-value-77", "x-trace": "t1"},
        api_key="field-value-not-a-pattern",
        notes=["AKIAIOSFODNN7EXAMPLE", ("sk-proj-0123456789abcdefghij",)],
        jwt="eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJl",
        tokens_in=1234,
        prompt_tokens=99,
        work="task-queue",
    )
    try:
        raise RuntimeError("401 from provider, key=plainlookingvalue42")
    except RuntimeError:
        logger.exception("loss.failed", reason="auth")
    # A third-party (stdlib) logger goes through the same scrubber.
    logging.getLogger("some.library").error("retrying with sk-ant-api03-AbCdEfGhIjKlMnOpQrStUv")

    for text in (log_file.read_text(encoding="utf-8"), tty.getvalue()):
        for secret in secrets:
            assert secret not in text
        assert "[redacted]" in text
    first, second, third = read_lines(log_file)
    assert first["tokens_in"] == 1234 and first["prompt_tokens"] == 99  # counts, not secrets
    assert first["work"] == "task-queue"
    assert first["headers"] == {"Authorization": "[redacted]", "x-trace": "t1"}
    assert first["api_key"] == "[redacted]"
    assert second["exception"][0]["exc_value"] == "401 from provider, key=[redacted]"
    assert third["logger"] == "some.library" and "[redacted]" in third["event"]


def test_scrub_leaves_ordinary_text_alone() -> None:
    text = "ep05.txt is empty; task-queue full; 12 tokens; Bearer of bad news"
    assert scrub(text) == text
    assert scrub({"tokens_out": 5, "max_tokens": 10, "n": None}) == {
        "tokens_out": 5,
        "max_tokens": 10,
        "n": None,
    }
    assert scrub(Path("/srv/runs/r7")) == "/srv/runs/r7"


def test_a_value_scrubbed_before_its_key_was_configured_is_redacted_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Short strings' scrubbed text is kept (every line repeats them): a key set
    # later must not be served the text kept from before it existed.
    line = {"event": "llm.error", "reason": "refused key plain7value7late"}
    assert scrub(line) == line
    monkeypatch.setenv("SKILLTRAIN_LATE_API_KEY", "plain7value7late")
    assert scrub(line)["reason"] == "refused key [redacted]"
    monkeypatch.delenv("SKILLTRAIN_LATE_API_KEY")
    assert scrub(line) == line


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("key sk-ant-api03-AbCdEfGhIjKlMnOpQrStUv refused", "AbCdEfGhIjKlMnOpQrStUv"),
        ("sent Bearer opaque-bearer-value-77 upstream", "opaque-bearer-value-77"),
        ("as AKIAIOSFODNN7EXAMPLE in us-east-1", "AKIAIOSFODNN7EXAMPLE"),
        ("with AIzaSyA1234567890abcdefghijklmnopqrstu here", "SyA1234567890abcdefghijklmnopqrstu"),
        ("token ghp_0123456789abcdefghijklmnopqrstuvwxyz ok", "456789abcdefghijklmnopqrstuvwxyz"),
        ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJl x", "c2lnbmF0dXJl"),
        ("header X-Api-Key: d41d8cd98f00b204e9800998ecf8427e set", "d41d8cd98f00b204e98"),
    ],
    ids=["sk", "bearer", "aws", "google", "github", "jwt", "key-value"],
)
def test_every_secret_shape_is_scrubbed_inside_free_text(text: str, secret: str) -> None:
    # One combined search decides whether a string needs the substitutions:
    # each shape must pass it.
    scrubbed = scrub(text)
    assert secret not in scrubbed and "[redacted]" in scrubbed


def test_a_line_is_sealed_against_the_answer_keys_installed_when_it_is_written(
    log_file: Path,
) -> None:
    from skilltrain.daemon.guard import leakguard

    passage = "Mara counts the crates twice and never writes the number down anywhere."
    configure(log_file=log_file, stderr=io.StringIO())
    try:
        leakguard.install(leakguard.AnswerKeys([leakguard.HumanIndex.build(
            "other", {1: "A different screenplay about a lighthouse keeper and his dog."})]))
        get_logger().info("test.before", note=passage)
        leakguard.install(leakguard.AnswerKeys([leakguard.HumanIndex.build(
            "docks", {1: f"INT. DOCK - NIGHT\n\n{passage}\n"})]))
        get_logger().info("test.after", note=passage)
    finally:
        leakguard.install(None)
    before, after = read_lines(log_file)
    assert before["note"] == passage  # no installed work held it then
    assert after["note"].startswith(leakguard.REDACTION_MARKER)
    assert "crates twice" not in after["note"]


def test_the_stamp_is_the_logs_own_so_a_timestamp_from_elsewhere_cannot_carry_text(
    log_file: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seal and the scrub pass the line's timestamp over (it is new on every
    line) only in the stamper's own form. A caller's, a context's or a plain
    library record's value is stamped over; a record that skipped our
    structlog chain (a library's own chain ending in wrap_for_formatter, or
    extra=_logger/_name) keeps its own, so it is sealed and scrubbed like any
    field, and such a library's debug record is withheld like any other."""
    import structlog

    from skilltrain.daemon.guard import leakguard

    passage = "Mara counts the crates twice and never writes the number down anywhere."
    secret = "sk-stamp-test-0123456789abcdefghij"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    configure(log_file=log_file, stderr=io.StringIO(), level="debug")
    library = structlog.wrap_logger(
        logging.getLogger("somelib"), wrapper_class=structlog.stdlib.BoundLogger,
        processors=[structlog.stdlib.ProcessorFormatter.wrap_for_formatter])
    try:
        leakguard.install(leakguard.AnswerKeys([leakguard.HumanIndex.build(
            "docks", {1: f"INT. DOCK - NIGHT\n\n{passage}\n"})]))
        get_logger().info("test.stamped", timestamp=passage)
        get_logger().info("test.stamped", timestamp=secret)
        logging.getLogger("somelib").warning("hello", extra={"timestamp": passage})
        library.info("lib.stamped", timestamp=passage)
        library.info("lib.stamped", timestamp=secret, note=secret)
        library.debug("lib.debug", note="a library's debug record")
        logging.getLogger("somelib").warning({"event": "forged", "timestamp": passage},
                                             extra={"_logger": None, "_name": "warning"})
    finally:
        leakguard.install(None)
    text = log_file.read_text(encoding="utf-8")
    assert "crates twice" not in text and "sk-stamp-test" not in text
    assert "a library's debug record" not in text
    lines = read_lines(log_file)
    assert len(lines) == 7
    for line in lines[:3]:  # stamped by the log
        assert datetime.fromisoformat(line["timestamp"]).tzinfo is not None
    assert [line["event"] for line in lines[3:]] == [
        "lib.stamped", "lib.stamped", "library.withheld", "forged"]


def test_console_on_a_tty_json_otherwise(log_file: Path) -> None:
    tty = FakeTTY()
    configure(log_file=log_file, stderr=tty)
    get_logger().info("daemon.ready", pid=42)
    out = tty.getvalue()
    assert "\x1b[" in out and "daemon.ready" in out and "pid" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)

    forced = FakeTTY()
    configure(log_file=log_file, stderr=forced, stderr_format="json")
    get_logger().info("daemon.ready", pid=43)
    assert json.loads(forced.getvalue())["pid"] == 43

    pipe = io.StringIO()
    configure(log_file=log_file, stderr=pipe, stderr_format="console")
    get_logger().info("daemon.ready", pid=44)
    assert "\x1b[" in pipe.getvalue()


def test_level_and_noisy_third_party_loggers(log_file: Path, answer_keys: None) -> None:
    configure(log_file=log_file, level="info", stderr=io.StringIO())
    get_logger().debug("scan.detail")
    logging.getLogger("httpx").info("HTTP Request: POST http://127.0.0.1/v1")
    logging.getLogger("apscheduler.executors.default").info("Job executed")
    logging.getLogger("httpx").warning("httpx trouble")
    get_logger().info("daemon.ready")
    assert [x["event"] for x in read_lines(log_file)] == ["httpx trouble", "daemon.ready"]

    configure(log_file=log_file, level="debug", stderr=io.StringIO())
    logging.getLogger("httpx").info("HTTP Request: again")
    logging.getLogger("httpx").debug("request body: <the prompt>")
    get_logger().debug("scan.detail")
    *_, again, withheld, detail = read_lines(log_file)
    assert (again["event"], detail["event"]) == ("HTTP Request: again", "scan.detail")
    # Below INFO a library's record is its size and hash, never its text.
    assert withheld == {**withheld, "event": "library.withheld", "level": "debug",
                        "logger": "httpx", "chars": 26}
    assert "prompt" not in json.dumps(withheld)


def test_bad_level_is_refused(log_file: Path) -> None:
    with pytest.raises(ValueError, match="verbose"):
        configure(log_file=log_file, level="verbose", stderr=io.StringIO())


def test_litellm_handlers_are_adopted() -> None:
    lib = logging.getLogger("LiteLLM")
    own = logging.StreamHandler(io.StringIO())
    lib.addHandler(own)
    try:
        slog.adopt_library_loggers()
        assert own not in lib.handlers and lib.propagate
    finally:
        lib.removeHandler(own)


def test_a_line_after_shutdown_goes_nowhere_not_to_stderr_unsealed(tmp_path: Path) -> None:
    """With no handler left, logging's lastResort printed a late line's fields
    (a thread's, at exit) to stderr: scrubbed, never sealed."""
    import subprocess
    import sys

    passage = "Mara counts the crates twice and never writes the number down anywhere."
    script = f"""
import io
from pathlib import Path
from skilltrain.daemon.infra import log
from skilltrain.daemon.guard import leakguard
log.configure(log_file=Path({str(tmp_path / "d.log")!r}), stderr=io.StringIO())
leakguard.install(leakguard.AnswerKeys([leakguard.HumanIndex.build("docks", {{1: {passage!r}}})]))
log.shutdown()
log.get_logger("skilltrain.daemon").warning("late.audit", note={passage!r})
import logging; logging.getLogger("somelib").error({passage!r})
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stderr
    assert "crates twice" not in result.stderr + result.stdout
