"""Answer-key integrity end to end: the leak guard on real reports from the
loopback LLM, and `skilltrain audit` over a tree the daemon wrote."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skilltrain.daemon.core import config
from skilltrain.daemon.core.errors import RefusedError
from skilltrain.daemon.core.templates import PromptTemplates
from skilltrain.daemon.guard import leakguard
from skilltrain.handlers import loss
from tests.llm_server import LLMServer, Reply

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "data" / "example"
SKILLTRAIN = Path(sys.executable).with_name("skilltrain")

pytestmark = pytest.mark.filterwarnings(
    "ignore:unclosed <socket.socket:ResourceWarning",  # litellm's pooled clients
)


def dialogue_lines(text: str, count: int) -> list[str]:
    """Lines of dialogue long enough to be a quote, not a stock phrase."""
    lines = [line.strip() for line in text.splitlines()]
    picked = [line for line in lines
              if len(line.split()) >= 9 and not line.isupper() and not line.startswith("(")]
    assert len(picked) >= count
    return picked[:count]


@pytest.fixture
def job(example_loss_job: loss.LossJob) -> loss.LossJob:
    return example_loss_job


def run(job: loss.LossJob, server: LLMServer, on_leak: str) -> loss.LossResult:
    settings = config.LLMConfig(model="openai/loopback-model", api_base=server.url, timeout_s=10,
                                max_retries=0)
    return loss.run(job, settings=settings, templates=PromptTemplates(REPO / "prompts"),
                    on_leak=on_leak, confine_to=job.report_path.parents[4])


def quoting_report() -> tuple[str, list[str]]:
    """A report that quotes 3 human lines verbatim and 1 with its punctuation changed."""
    human = (EXAMPLE / "human" / "ep01.txt").read_text(encoding="utf-8")
    quotes = dialogue_lines(human, 4)
    altered = quotes[3].replace(",", "").replace(".", "!").replace("'", "").upper()
    body = "\n\n".join([
        "The human version trusts silence. Compare these moments:",
        f'First, "{quotes[0]}" which lands because nothing explains it.',
        f"> {quotes[1]}",
        f"Later: {quotes[2]} -- a line that does two jobs.",
        f"And the turn: {altered}",
        "The model's draft states every feeling instead.",
    ])
    return body, quotes


def test_redact_removes_every_verbatim_and_near_verbatim_quote(
        job: loss.LossJob, llm_server: LLMServer) -> None:
    body, quotes = quoting_report()
    llm_server.script(Reply.ok(body))

    result = run(job, llm_server, "redact")

    report = job.report_path.read_text(encoding="utf-8")
    assert result.leaks_redacted == 4
    assert report.count(leakguard.REDACTION_MARKER) == 4
    normalised = " ".join(leakguard.tokens(report))
    for quote in quotes:
        assert " ".join(leakguard.tokens(quote)) not in normalised
    assert "The model's draft states every feeling instead." in report  # prose kept
    sidecar = json.loads(job.sidecar_path.read_text(encoding="utf-8"))
    assert sidecar["leaks_redacted"] == 4


def test_refuse_writes_nothing(job: loss.LossJob, llm_server: LLMServer) -> None:
    body, _ = quoting_report()
    llm_server.script(Reply.ok(body))

    with pytest.raises(RefusedError, match="quotes the human screenplay verbatim in 4 place"):
        run(job, llm_server, "refuse")

    assert not job.report_path.parent.exists() or not any(job.report_path.parent.iterdir())


def test_quotes_of_the_models_own_episodes_are_untouched(
        job: loss.LossJob, llm_server: LLMServer) -> None:
    draft = (job.scripts_dir / "ep02.txt").read_text(encoding="utf-8")
    quotes = dialogue_lines(draft, 3)
    body = "The draft explains itself:\n\n" + "\n\n".join(f'"{q}"' for q in quotes)
    llm_server.script(Reply.ok(body))

    result = run(job, llm_server, "redact")

    assert result.leaks_redacted == 0
    assert job.report_path.read_text(encoding="utf-8") == body + "\n"


def test_lines_the_model_wrote_as_the_human_did_may_be_quoted_the_others_not(
        job: loss.LossJob, llm_server: LLMServer) -> None:
    # The draft's own lines above are in no human text: a guard that ignored
    # what the model wrote would pass that test too. Here the writer wrote
    # two lines exactly as the human did (a closed-book writer can land on
    # the same line): quoting them is quoting the model. A third human line,
    # not in the draft, is still a leak in the same report.
    human = (EXAMPLE / "human" / "ep02.txt").read_text(encoding="utf-8")
    shared_1, shared_2, human_only = dialogue_lines(human, 3)
    ep02 = job.scripts_dir / "ep02.txt"
    ep02.write_text(ep02.read_text(encoding="utf-8")
                    + f"\nDEV\n{shared_1}\n\nMAGS\n{shared_2}\n", encoding="utf-8")
    kept = ("The draft lands two lines as the original does:\n\n"
            f'"{shared_1}"\n\n> {shared_2}\n\n')
    body = kept + f"But it never finds this one: {human_only}\n\nThe rest explains too much."
    llm_server.script(Reply.ok(body))

    result = run(job, llm_server, "redact")

    report = job.report_path.read_text(encoding="utf-8")
    assert result.leaks_redacted == 1
    assert report.startswith(kept)
    assert human_only not in report and report.count(leakguard.REDACTION_MARKER) == 1


def test_audit_is_clean_after_a_daemon_run_and_finds_a_planted_leak(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # A whole daemon run on the example, the reviewer quoting the answer key
    # from the prompt it received, as LLMs do: the guard redacts, the audit
    # then finds nothing in anything the daemon wrote (reports, archives,
    # sidecars, state, log).
    root = tmp_path / "ws"
    shutil.copytree(EXAMPLE, root / "data" / "example")
    shutil.copytree(REPO / "prompts", root / "prompts")
    for n in range(1, 7):
        scripts = root / "runs" / "r1" / "epoch_00" / "step_00" / "example" / "scripts"
        scripts.mkdir(parents=True, exist_ok=True)
        shutil.copy(EXAMPLE / "model_draft" / f"ep{n:02d}.txt", scripts)
    (scripts / "_SUCCESS").touch()
    human_lines = [line for n in range(1, 7) for line in dialogue_lines(
        (EXAMPLE / "human" / f"ep{n:02d}.txt").read_text(encoding="utf-8"), 2)]

    def quoting(request: object) -> Reply:
        prompt = "\n".join(str(m.get("content")) for m in request.messages)  # type: ignore[attr-defined]
        quote = next(line for line in human_lines if line in prompt)
        return Reply.ok(f"The original is spare.\n\n> {quote}\n\nThe model over-explains.")

    llm_server.default = quoting
    (root / "config.toml").write_text(
        f'[llm]\nmodel = "openai/loopback-model"\napi_base = "{llm_server.url}"\n'
        "max_retries = 0\n[integrity]\naudit_on_start = false\n", encoding="utf-8")
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    done = subprocess.run([str(SKILLTRAIN), "daemon", "--once", "--config",
                           str(root / "config.toml")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert llm_server.request_count == 2
    audit = [str(SKILLTRAIN), "audit", "--config", str(root / "config.toml")]

    clean = subprocess.run(audit, env=env, capture_output=True, text=True, timeout=60)
    assert clean.returncode == 0, clean.stdout
    assert "no answer-key passages" in clean.stdout

    planted = root / "runs" / "r1" / "notes" / "deep" / "scratch.txt"
    planted.parent.mkdir(parents=True)
    planted.write_text(f"notes\n{human_lines[5]}\n", encoding="utf-8")
    dirty = subprocess.run(audit, env=env, capture_output=True, text=True, timeout=60)
    assert dirty.returncode == 1
    assert "scratch.txt:2" in dirty.stdout


def test_refuse_mode_a_contradicted_report_is_retried_and_never_reaches_the_optimizer(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # Issue 25: a whole, well-formed report whose claims the measurements
    # contradict is bogus signal in refuse mode: one loss.contradicted, nothing
    # written, the set retried like a failed call; the second, true reply is
    # written with its claim counts, and only then is the step reported.
    root = tmp_path / "ws"
    shutil.copytree(EXAMPLE, root / "data" / "example")
    shutil.copytree(REPO / "prompts", root / "prompts")
    scripts = root / "runs" / "r1" / "epoch_00" / "step_00" / "example" / "scripts"
    scripts.mkdir(parents=True)
    for n in range(1, 7):
        shutil.copy(EXAMPLE / "model_draft" / f"ep{n:02d}.txt", scripts)
    (scripts / "_SUCCESS").touch()
    seen: list[str] = []

    def reviewer(request: object) -> Reply:
        prompt = "\n".join(str(m.get("content")) for m in request.messages)  # type: ignore[attr-defined]
        first = "EP 01" if "=== Model EP 01 ===" in prompt else "EP 04"
        seen.append(first)
        # The model's speeches are longer than the human's in every range.
        direction = "lower" if seen.count(first) == 1 else "higher"
        return Reply.ok(f"Speeches differ.\n\n## Claims\n\n- speech_words_mean: {direction}\n")

    llm_server.default = reviewer
    log = root / "daemon.jsonl"
    marker = root / "optimized.txt"
    (root / "config.toml").write_text(
        f'[llm]\nmodel = "openai/loopback-model"\napi_base = "{llm_server.url}"\n'
        f'max_retries = 0\n[loss]\nretry_backoff_s = 0.2\nmax_attempts = 3\n'
        f'[integrity]\naudit_on_start = false\non_contradiction = "refuse"\n'
        f'[log]\nfile = "{log}"\n'
        f'[optimizer]\ncommand = ["{sys.executable}", "-c", '
        f'"open(r\'{marker}\', \'a\').write(\'{{reports_dir}}\\\\n\')"]\n', encoding="utf-8")
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    once = [str(SKILLTRAIN), "daemon", "--once", "--config", str(root / "config.toml")]
    done = subprocess.run(once, env=env, capture_output=True, text=True, timeout=120)
    events = [json.loads(line) for line in log.read_text("utf-8").splitlines()]
    names = [e["event"] for e in events]
    refused = [e for e in events if e["event"] == "loss.contradicted"]
    assert len(refused) == 2, (done.stderr[-2000:], names)
    assert all(e["claims_contradicted"] == 1 and e["next_retry_s"] is not None for e in refused)
    assert "step.reported" not in names and not marker.exists()
    assert not list((root / "runs" / "r1" / "loss").rglob("*.md"))
    # --once does not wait out a retry: the next run takes the failed sets up again.
    subprocess.run(once, env=env, capture_output=True, text=True, timeout=120)
    events = [json.loads(line) for line in log.read_text("utf-8").splitlines()]
    names = [e["event"] for e in events]
    completed = [e for e in events if e["event"] == "loss.completed"]
    assert len(completed) == 2
    assert all(e["claims_confirmed"] == 1 and e["claims_contradicted"] == 0 for e in completed)
    # The optimizer ran once, after both true reports, and no report says "lower".
    assert names.index("step.reported") > max(i for i, n in enumerate(names)
                                              if n == "loss.contradicted")
    reported = next(e for e in events if e["event"] == "step.reported")
    assert reported["claims_contradicted_share"] == 0.0
    assert len(marker.read_text("utf-8").splitlines()) == 1
    reports = sorted(p for p in (root / "runs" / "r1" / "loss").rglob("*.md")
                     if not p.name.endswith("_prompt.md"))
    assert [p.name for p in reports] == ["example_ep01-03.md", "example_ep04-06.md"]
    assert all("speech_words_mean: higher" in p.read_text("utf-8") for p in reports)
    progress = subprocess.run([str(SKILLTRAIN), "progress", "--config",
                               str(root / "config.toml")], env=env, capture_output=True,
                              text=True, timeout=60)
    assert "contradicted" in progress.stdout.splitlines()[0]
    assert " 0% " in progress.stdout.splitlines()[1]
