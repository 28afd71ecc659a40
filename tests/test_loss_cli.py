"""`skilltrain loss`, the seed's one-shot command, run as the user runs it: a real
process, the repository's config.toml, the example work, the loopback server
reached through SKILLTRAIN_LLM_API_BASE.

Each process pays litellm's import (~4 s of CPU), so the processes of this
module are started together by one fixture and the tests read their results;
the cases that need no separate process go through cli.main in-process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from skilltrain.daemon.commands import cli
from skilltrain.daemon.core import atomic
from tests.llm_server import LLMServer, Reply

# litellm's lazily imported modules (github_copilot's authenticator, the thinking
# block types) make pydantic warn about TypedDict ReadOnly items the first time a
# code path builds their schema; which test pays that depends on the order.
pytestmark = pytest.mark.filterwarnings("ignore:.* using the `ReadOnly` qualifier:UserWarning")

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "data" / "example"
REPORT = (
    "The draft states feelings the original leaves to action. Scenes in the draft "
    "arrive early and leave late; the endings resolve instead of turning."
)
OLD = {
    "example_ep01-03.md": "OLD REPORT, complete.\n",
    "example_ep01-03_prompt.md": "OLD ARCHIVE\n",
    "example_ep01-03.json": '{"old": true}\n',
}


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str
    scripts: Path
    out: Path


def human_lines() -> list[str]:
    """Answer-key lines of ep01-03 over 20 characters that the model's draft does not share."""
    names = [f"ep{n:02d}.txt" for n in (1, 2, 3)]
    model = "".join((EXAMPLE / "model_draft" / name).read_text() for name in names)
    lines = (
        line.strip()
        for name in names
        for line in (EXAMPLE / "human" / name).read_text().splitlines()
    )
    return [line for line in lines if len(line) > 20 and line not in model]


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKILLTRAIN_")}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", OPENAI_API_KEY="sk-test-loopback")
    return env


def scripts_dir(root: Path, name: str) -> Path:
    folder = root / name / "epoch_00" / "step_00" / "example" / "scripts"
    folder.mkdir(parents=True)
    for n in (1, 2, 3):
        shutil.copy(EXAMPLE / "model_draft" / f"ep{n:02d}.txt", folder)
    return folder


def loss_argv(scripts: Path, out: Path, model: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "skilltrain",
        "loss",
        "--work",
        "data/example",
        "--first",
        "1",
        "--last",
        "3",
        "--scripts",
        str(scripts),
        "--out",
        str(out),
        "--model",
        model,
    ]


@dataclass
class Runs:
    loopback: Finished
    builtin: Finished
    killed: Finished
    server: LLMServer
    killed_while_waiting: bool


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    root = tmp_path_factory.mktemp("cli")
    server = LLMServer().start()
    hanging = LLMServer(default=lambda request: Reply.hang(120)).start()
    # The first request fails, so the retry line and the env overrides are exercised too.
    server.script(Reply.status(503), Reply.ok(REPORT))
    env = base_env() | {
        "SKILLTRAIN_LLM_API_BASE": server.url,
        "SKILLTRAIN_LLM_BACKOFF_INITIAL_S": "0.01",
        "SKILLTRAIN_LLM_MAX_RETRIES": "2",
        # Not the config's default model, so --model has to do the choosing.
        "SKILLTRAIN_LLM_MODEL": "openai/not-this-model",
    }
    plans: dict[str, tuple[Path, Path, str, dict[str, str]]] = {}
    for name, model in (
        ("loopback", "openai/loopback-model"),
        ("builtin", "builtin/craft-metrics"),
        ("killed", "openai/loopback-model"),
    ):
        scripts = scripts_dir(root, name)
        out = root / name / "loss" / "epoch_00" / "step_00" / "example_ep01-03.md"
        run_env = env | ({"SKILLTRAIN_LLM_API_BASE": hanging.url} if name == "killed" else {})
        plans[name] = (scripts, out, model, run_env)
    killed_out = plans["killed"][1]
    killed_out.parent.mkdir(parents=True)
    for file_name, text in OLD.items():
        (killed_out.parent / file_name).write_text(text)

    procs = {
        name: subprocess.Popen(
            loss_argv(scripts, out, model),
            cwd=REPO,
            env=run_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (scripts, out, model, run_env) in plans.items()
    }
    try:
        # SIGKILL the "killed" run while it waits for the hanging server.
        deadline = time.monotonic() + 60
        while hanging.request_count == 0 and procs["killed"].poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        waiting = hanging.request_count == 1 and procs["killed"].poll() is None
        procs["killed"].send_signal(signal.SIGKILL)
        finished = {}
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=90)
            scripts, out, _, _ = plans[name]
            finished[name] = Finished(proc.returncode, stdout, stderr, scripts, out)
        yield Runs(server=server, killed_while_waiting=waiting, **finished)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        hanging.stop()
        server.stop()


def test_loss_with_the_loopback_model_writes_the_set_and_says_so(runs: Runs) -> None:
    run = runs.loopback

    assert run.returncode == 0, run.stderr
    assert run.out.read_text(encoding="utf-8") == REPORT + "\n"
    assert run.out.with_name("example_ep01-03_prompt.md").is_file()
    sidecar = json.loads(run.out.with_name("example_ep01-03.json").read_text())
    request = runs.server.requests[-1]
    assert sidecar["model"] == "openai/loopback-model"
    assert sidecar["attempts"] == 2
    lines = run.stdout.splitlines()
    assert len(lines) == 2, run.stdout
    # No token count: litellm knows no window for this model, nothing to check it against.
    started = re.fullmatch(r"\[loss\] example ep01-03, prompt ([\d,]+) chars", lines[0])
    assert started, lines[0]
    assert int(started.group(1).replace(",", "")) == request.prompt_chars
    assert sidecar["prompt_tokens"] is None
    size = len((REPORT + "\n").encode())
    assert lines[1] == (
        f"[loss] wrote {run.out} ({size:,} bytes; {sidecar['tokens_in']:,} tokens in, "
        f"{sidecar['tokens_out']:,} out, 0 cached, unknown cost, 0 leaks redacted)"
    )


def test_loss_retry_is_reported_on_stderr_in_one_line(runs: Runs) -> None:
    run = runs.loopback

    assert runs.server.request_count == 2  # 503, then the report
    assert re.fullmatch(
        r"\[loss\] attempt 1 failed \(ServiceUnavailableError \(HTTP 503\): [^\n]*\); "
        r"retrying in \d+\.\ds\n",
        run.stderr,
    ), run.stderr


def test_loss_cli_request_carries_the_env_settings_and_both_screenplays(runs: Runs) -> None:
    request = runs.server.requests[-1]

    assert request.model == "loopback-model"
    assert request.headers.get("authorization") == "Bearer sk-test-loopback"
    content = request.messages[0]["content"]
    assert len(human_lines()) > 50
    assert all(line in content for line in human_lines())
    archive = runs.loopback.out.with_name("example_ep01-03_prompt.md").read_text()
    assert [line for line in human_lines() if line in archive] == []


def test_loss_with_the_builtin_model_needs_no_server(runs: Runs) -> None:
    run = runs.builtin

    assert run.returncode == 0, run.stderr
    report = run.out.read_text(encoding="utf-8")
    assert report.startswith("Built-in metrics reviewer")
    assert [line for line in human_lines() if line in report] == []
    sidecar = json.loads(run.out.with_name("example_ep01-03.json").read_text())
    assert sidecar["model"] == "builtin/craft-metrics"
    assert sidecar["cost_usd"] == 0.0
    assert sidecar["report_sha256"] == hashlib.sha256(report.encode()).hexdigest()
    assert "$0.0000" in run.stdout
    assert run.stderr == ""


def test_sigkill_while_waiting_for_the_llm_leaves_the_old_set_untouched(runs: Runs) -> None:
    run = runs.killed

    assert runs.killed_while_waiting
    assert run.returncode == -signal.SIGKILL
    assert {p.name: p.read_text() for p in run.out.parent.iterdir()} == OLD
    assert list(atomic.leftover_temp_files(run.out.parent)) == []


# --------------------------------------------------------------------------- in-process


def _config(tmp_path: Path, api_base: str, max_retries: int = 0) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'[paths]\nprompts = "{REPO / "prompts"}"\n'
        f'[llm]\nmodel = "openai/loopback-model"\napi_base = "{api_base}"\n'
        f"max_retries = {max_retries}\nbackoff_initial_s = 0.01\ntimeout = 10\n"
    )
    return path


def _main(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    code = caught.value.code
    assert isinstance(code, int)
    return code


def _loss_args(tmp_path: Path, config: Path) -> list[str]:
    scripts = tmp_path / "scripts"
    if not scripts.exists():
        scripts.mkdir()
        for n in (1, 2, 3):
            shutil.copy(EXAMPLE / "model_draft" / f"ep{n:02d}.txt", scripts)
    return [
        "loss",
        "--config",
        str(config),
        "--work",
        str(EXAMPLE),
        "--first",
        "1",
        "--last",
        "3",
        "--scripts",
        str(scripts),
        "--out",
        str(tmp_path / "out" / "r.md"),
    ]


def test_loss_refusal_exits_1_with_one_line_and_writes_nothing(
    tmp_path: Path, llm_server: LLMServer, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _loss_args(tmp_path, _config(tmp_path, llm_server.url))
    (tmp_path / "scripts" / "ep02.txt").unlink()

    code = _main(args)

    out, err = capsys.readouterr()
    assert code == 1
    assert out == ""
    assert err == f"[loss] refused: model episode ep02.txt is missing in {tmp_path / 'scripts'}\n"
    assert not (tmp_path / "out").exists()
    assert llm_server.request_count == 0


def test_loss_llm_failure_exits_1_with_one_line(
    tmp_path: Path, llm_server: LLMServer, capsys: pytest.CaptureFixture[str]
) -> None:
    llm_server.script(Reply.status(401))

    code = _main(_loss_args(tmp_path, _config(tmp_path, llm_server.url, max_retries=3)))

    err = capsys.readouterr().err
    assert code == 1
    assert llm_server.request_count == 1
    assert re.fullmatch(r"\[loss\] failed: AuthenticationError \(HTTP 401\): [^\n]*\n", err), err
    assert not (tmp_path / "out").exists()


def test_loss_with_a_bad_work_folder_exits_2(
    tmp_path: Path, llm_server: LLMServer, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _loss_args(tmp_path, _config(tmp_path, llm_server.url))
    args[args.index("--work") + 1] = str(tmp_path / "no-such-work")

    assert _main(args) == 2
    assert capsys.readouterr().err == (
        f"skilltrain: work folder {tmp_path / 'no-such-work'} does not exist\n"
    )
    assert llm_server.request_count == 0


@pytest.mark.parametrize("timeout", ["-1", "0"])
def test_loss_rejects_a_timeout_that_is_not_positive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], timeout: str
) -> None:
    # The built-in model takes no socket, so the bug cannot leak one into other tests.
    args = _loss_args(tmp_path, _config(tmp_path, "http://127.0.0.1:9/v1"))
    args += ["--model", "builtin/craft-metrics", "--timeout", timeout]

    code = _main(args)

    err = capsys.readouterr().err
    assert code == 2
    assert "timeout" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- --help


@pytest.mark.parametrize("argv", [["--help"], ["loss", "--help"], ["status", "--help"]])
def test_help_does_not_import_litellm(argv: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "skilltrain", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env=base_env(),
        cwd=REPO,
    )

    assert proc.returncode == 0
    assert "usage: skilltrain" in proc.stdout
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert "skilltrain.daemon.commands.cli" in imported  # the measurement itself works
    assert not [m for m in imported if m.split(".")[0] in ("litellm", "openai", "tiktoken")]


def test_loss_refuses_a_copy_of_another_works_key_unsent(
    tmp_path: Path, llm_server: LLMServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # Run alone, the command knew only its own work's key: another work's episode
    # copied into scripts/ was sent, and archived beside the report.
    data = tmp_path / "data"
    shutil.copytree(EXAMPLE, data / "example")
    other = data / "other" / "human"
    other.mkdir(parents=True)
    # Brick & Steel, the Fountain format's public sample: a screenplay of its own.
    text = (REPO / "tests" / "corpus" / "brick_and_steel.txt").read_text(encoding="utf-8")
    (other / "ep01.txt").write_text(text, encoding="utf-8")
    args = _loss_args(tmp_path, _config(tmp_path, llm_server.url))
    args[args.index(str(EXAMPLE))] = str(data / "example")
    (tmp_path / "scripts" / "ep02.txt").write_text(text, encoding="utf-8")

    code = _main(args)

    _, err = capsys.readouterr()
    assert code == 1
    assert "the text of human ep01.txt of work other" in err, err
    assert not (tmp_path / "out").exists()
    assert llm_server.request_count == 0
