"""First contact and LLM faults: exit codes, messages, bounds.

What a new user meets first: a missing key, a closed api_base, a misspelt
template variable, a missing data/ folder, no config.toml at all, a bad
command line. Each must end with one clear line and the documented exit code,
create nothing it should not, and never import litellm to say so. And what a
misbehaving server does: a reply trickled one byte at a time must not hold a
job past `[llm] timeout` x attempts plus backoff; `choices: []` is a bad reply
retried, not an internal error.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from skilltrain.daemon.core.errors import ConfigError, ExitCode
from tests.daemon_helpers import (
    SKILLTRAIN,
    InProcessDaemon,
    SetId,
    Workspace,
    build_workspace,
    run_cli,
    run_once_in_process,
    subprocess_env,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import LLMServer, Reply

pytestmark = DAEMON_TEST_MARKS

NO_AUDIT = "[integrity]\naudit_on_start = false\n"
S = SetId("r1", 1, 1, "alpha", 1, 3)



def workspace(root: Path, url: str, llm_timeout_s: float = 5.0) -> Workspace:
    ws = build_workspace(
        root, url, works={"alpha": 3}, settle_s=0.2, extra=NO_AUDIT, llm_timeout_s=llm_timeout_s
    )
    ws.write_step("r1", 1, 1, success=True)
    return ws


def daemon_once(
    ws: Workspace, env: dict[str, str] | None = None, cwd: Path | None = None, *args: str
) -> subprocess.CompletedProcess[str]:
    argv = [str(SKILLTRAIN), "daemon", "--once", *args]
    if not args:
        argv += ["--config", str(ws.config_path)]
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=60,
        env=env or subprocess_env(),
        cwd=cwd or ws.root,
        stdin=subprocess.DEVNULL,
    )


def json_lines(stderr: str) -> list[dict[str, object]]:
    assert all(line.startswith("{") for line in stderr.splitlines()), stderr
    return [json.loads(line) for line in stderr.splitlines()]


# ------------------------------------------------------------------ LLM faults


def test_a_trickling_server_is_cut_at_the_timeout_for_the_whole_request(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    # One byte every 20 ms, fifty times faster than the 1 s per-read timeout of
    # the HTTP client, which therefore never fires: the reply (~700 bytes)
    # would take ~14 s. Only the bound on the whole request can end an attempt,
    # at 1 s: 2 attempts, backoff at most 0.2 s, so the job is over after
    # 2 s and well within 4 s, with no report.
    ws = workspace(tmp_path, llm_server.url, llm_timeout_s=1.0)
    llm_server.default = lambda request: Reply.trickle(0.02)
    d = InProcessDaemon(ws, once=True).start()
    t0 = time.monotonic()
    try:
        d.run_once()
        took = time.monotonic() - t0
    finally:
        d.stop("once: idle")
    print(f"job over after {took:.2f}s (bound: 2 x 1 s + backoff)")
    assert 2.0 <= took < 4.0
    assert len(ws.events("loss.failed")) == 1
    assert len(ws.events("loss.retry")) == 1 and llm_server.request_count == 2
    assert not ws.has_report(S) and d.daemon.failures == 1


def test_a_reply_without_choices_is_a_bad_reply_retried_not_an_internal_error(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    ws = workspace(tmp_path, llm_server.url)
    llm_server.script(Reply.no_choices())
    d = InProcessDaemon(ws, once=True).start()
    try:
        d.run_once()
    finally:
        d.stop("once: idle")
    (retry,) = ws.events("loss.retry")
    assert "malformed reply" in retry["error"] and "no choices" in retry["error"]
    assert ws.has_report(S)
    bad = [e for e in ws.events() if "exception" in e or e.get("reason") == "internal error"]
    assert bad == []


# ---------------------------------------------------------------- credentials


def test_a_provider_model_without_its_key_is_a_config_error_before_any_job(
    tmp_path: Path, llm_server: LLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = workspace(tmp_path, llm_server.url)
    text = ws.config_path.read_text().replace(
        'model = "openai/loopback-model"', 'model = "openai/gpt-4o-mini"'
    )
    ws.config_path.write_text(text.replace(f'api_base = "{llm_server.url}"\n', ""))
    monkeypatch.delenv("OPENAI_API_KEY")

    with pytest.raises(ConfigError) as caught:
        InProcessDaemon(ws, once=True).start()

    assert caught.value.exit_code == ExitCode.CONFIG == 2
    assert "OPENAI_API_KEY" in str(caught.value) and "not set" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert llm_server.request_count == 0 and not ws.runs.joinpath(".skilltrain").exists()


def test_a_local_server_via_api_base_needs_no_key(
    tmp_path: Path, llm_server: LLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = workspace(tmp_path, llm_server.url)
    monkeypatch.delenv("OPENAI_API_KEY")

    run_once_in_process(ws)

    assert ws.has_report(S)
    assert llm_server.requests[0].headers["authorization"] == "Bearer no-key-needed"


def test_once_exits_1_when_a_set_failed_and_names_the_closed_api_base(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
    ws = workspace(tmp_path, url)

    result = daemon_once(ws)

    # 1 when anything failed, for cron and scripts (0 otherwise: see the runs/ test).
    assert result.returncode == ExitCode.FAILURE == 1, result.stderr[-2000:]
    (failed,) = ws.events("loss.failed")
    assert url in failed["reason"]
    (stopped,) = ws.events("daemon.stopped")
    assert stopped["exit_code"] == 1 and stopped["level"] == "error"


# ------------------------------------------------------------ config at start


def test_a_template_that_cannot_render_is_exit_2_at_start(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    ws = workspace(tmp_path, llm_server.url)
    template = ws.root / "prompts" / "loss.md.j2"
    template.write_text(template.read_text().replace("{{ title }}", "{{ tilte }}"))

    result = daemon_once(ws)

    assert result.returncode == ExitCode.CONFIG, result.stderr
    (failed,) = [e for e in json_lines(result.stderr) if e["event"] == "daemon.failed"]
    reason = str(failed["reason"])
    assert "'tilte' is undefined" in reason and str(template) in reason
    assert llm_server.request_count == 0 and ws.events("loss.started") == []


def test_a_missing_data_folder_is_exit_2_and_creates_nothing(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    ws = workspace(tmp_path, llm_server.url)
    os.rename(ws.runs, tmp_path / "runs-aside")
    text = ws.config_path.read_text().replace('data = "data"', 'data = "no-such-data"')
    ws.config_path.write_text(text)

    result = daemon_once(ws)

    assert result.returncode == ExitCode.CONFIG, result.stderr
    (line,) = json_lines(result.stderr)
    assert "[paths] data" in str(line["reason"]) and "no-such-data" in str(line["reason"])
    assert not ws.runs.exists()


def test_a_missing_runs_folder_is_created_and_said(tmp_path: Path, llm_server: LLMServer) -> None:
    ws = workspace(tmp_path, llm_server.url)
    for path in sorted(ws.runs.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    ws.runs.rmdir()

    assert daemon_once(ws).returncode == 0
    (created,) = ws.events("daemon.runs_created")
    assert created["runs_dir"] == str(ws.runs)


def test_a_bad_config_under_a_service_manager_is_one_json_event(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[llm]\nmodle = 'x'\n")

    result = run_cli("daemon", "--config", str(config), cwd=tmp_path)[0]

    assert result.returncode == ExitCode.CONFIG
    (event,) = json_lines(result.stderr)
    assert event["event"] == "daemon.failed" and event["level"] == "error"
    assert "unknown key [llm] modle" in str(event["reason"]) and event["exit_code"] == 2
    assert {"timestamp", "level", "event"} <= set(event)


# ------------------------------------------------------------ no config.toml


def test_daemon_without_config_toml_says_what_it_assumed_and_creates_nothing(
    tmp_path: Path,
) -> None:
    result = run_cli("daemon", "--once", cwd=tmp_path)[0]

    assert result.returncode == ExitCode.CONFIG, result.stderr
    notice, error = result.stderr.splitlines()
    assert f"no config.toml in {tmp_path}" in notice and f"runs={tmp_path / 'runs'}" in notice
    assert "[paths] data" in json.loads(error)["reason"]
    assert list(tmp_path.iterdir()) == []


def test_status_without_config_toml_says_so_and_creates_nothing(tmp_path: Path) -> None:
    result = run_cli("status", cwd=tmp_path)[0]

    assert result.returncode == 1
    assert f"no config.toml in {tmp_path}" in result.stderr
    assert f"{tmp_path / 'runs'} does not exist" in result.stderr
    assert "daemon not running" not in result.stdout
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------- command line


@pytest.mark.parametrize(
    ("first", "last", "rule"),
    [("3", "1", "--first must not be after --last"), ("-1", "2", "episode numbers are 0 or more")],
)
def test_loss_with_an_impossible_range_is_exit_2_before_litellm(
    tmp_path: Path, first: str, last: str, rule: str
) -> None:
    result, took = run_cli(
        "loss",
        "--work",
        str(tmp_path),
        "--scripts",
        str(tmp_path),
        "--out",
        str(tmp_path / "r.md"),
        "--first",
        first,
        "--last",
        last,
        python_flags=["-X", "importtime"],
    )
    assert result.returncode == ExitCode.CONFIG == 2
    assert rule in result.stderr
    modules = [ln.split("|")[-1].strip() for ln in result.stderr.splitlines() if "|" in ln]
    assert "skilltrain.daemon.commands.cli" in modules
    assert not [m for m in modules if m.split(".")[0] in ("litellm", "openai")]
    assert list(tmp_path.iterdir()) == []
    print(f"refused in {took:.2f}s")
