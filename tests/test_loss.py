"""The loss step end to end: real example files, the real template, real litellm
talking HTTP to the loopback server, real files written under tmp_path.

Every test checks the two product rules where they apply: the answer key
never reaches what is written (archive, sidecar, error messages), and a bad
input or output means a refusal with nothing written.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core import atomic, dataset
from skilltrain.daemon.core.config import LLMConfig
from skilltrain.daemon.core.errors import ConfigError, LLMError, RefusedError
from skilltrain.daemon.core.templates import PromptTemplates
from skilltrain.daemon.guard import leakguard
from skilltrain.daemon.infra import llm
from skilltrain.daemon.reviewer import craft_distance
from skilltrain.handlers import loss
from tests.llm_server import LLMServer, Reply

# litellm's lazily imported modules (github_copilot's authenticator, the thinking
# block types) make pydantic warn about TypedDict ReadOnly items the first time a
# code path builds their schema; which test pays that depends on the order.
pytestmark = pytest.mark.filterwarnings("ignore:.* using the `ReadOnly` qualifier:UserWarning")

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "data" / "example"
PROMPTS = REPO / "prompts"
REPORT = (
    "The model's episodes explain what the original shows. Scenes in the draft start "
    "early and end late; the original enters late and leaves on a question. Speeches "
    "in the draft are long and state feelings outright."
)
# A line of data/example/human/ep01.txt that the model's draft does not share.
HUMAN_LINE = (
    "A strip of cracked tarmac runs off the bank and down, straight into the shrunken lake."
)

SettingsFactory = Callable[..., LLMConfig]


# --------------------------------------------------------------------------- helpers


def episode_texts(folder: Path, first: int = 1, last: int = 3) -> list[str]:
    return [(folder / f"ep{n:02d}.txt").read_text(encoding="utf-8") for n in range(first, last + 1)]


def human_lines(first: int = 1, last: int = 3) -> list[str]:
    """Distinctive answer-key lines: non-blank, over 20 characters, not shared with the
    model's draft (a scene heading both versions use is the model's text too)."""
    model = "\n".join(episode_texts(EXAMPLE / "model_draft", first, last))
    lines = (
        line.strip()
        for text in episode_texts(EXAMPLE / "human", first, last)
        for line in text.splitlines()
    )
    return [line for line in lines if len(line) > 20 and line not in model]


def human_fragments(first: int = 1, last: int = 6) -> list[str]:
    """The distinctive lines and each of their sentences over 20 characters: an error
    message quoting one sentence of a long action line leaks as much as the line."""
    model = "\n".join(episode_texts(EXAMPLE / "model_draft", first, last))
    lines = human_lines(first, last)
    sentences = (s for line in lines for s in re.split(r"(?<=[.!?])\s+", line))
    return lines + [s for s in sentences if len(s) > 20 and s not in model]


def assert_no_human_text(text: str) -> None:
    fragments = human_fragments()
    assert len(fragments) > 100  # the check must have something to check
    assert HUMAN_LINE in fragments
    found = [fragment for fragment in fragments if fragment in text]
    assert not found, f"answer-key text found: {found[:3]}"


def assert_nothing_written(job: loss.LossJob, root: Path) -> None:
    """No report, archive or sidecar, and no temp file of an interrupted write."""
    for path in (job.report_path, job.archive_path, job.sidecar_path):
        assert not path.exists(), f"{path.name} was written"
    if job.report_path.parent.exists():
        assert list(job.report_path.parent.iterdir()) == []
    assert list(atomic.leftover_temp_files(root)) == []


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    """The writer's folder with the example's model draft ep01-03, as a run lays it out."""
    folder = tmp_path / "runs" / "r1" / "epoch_00" / "step_00" / "example" / "scripts"
    folder.mkdir(parents=True)
    for n in (1, 2, 3):
        shutil.copy(EXAMPLE / "model_draft" / f"ep{n:02d}.txt", folder)
    return folder


@pytest.fixture
def job(tmp_path: Path, scripts: Path) -> loss.LossJob:
    report = tmp_path / "runs" / "r1" / "loss" / "epoch_00" / "step_00" / "example_ep01-03.md"
    return loss.LossJob(
        work=dataset.load_work(EXAMPLE), scripts_dir=scripts, report_path=report, first=1, last=3
    )


@pytest.fixture
def work_copy(tmp_path: Path) -> Path:
    """A copy of the example work, for tests that break the answer key."""
    root = tmp_path / "data" / "example"
    shutil.copytree(EXAMPLE / "human", root / "human")
    shutil.copy(EXAMPLE / "work.toml", root)
    return root


@pytest.fixture
def settings(llm_server: LLMServer, llm_model: str) -> SettingsFactory:
    """LLMConfig for the loopback server; fast backoff, overridable per test."""

    def make(**overrides: Any) -> LLMConfig:
        values: dict[str, Any] = dict(
            model=llm_model,
            api_base=llm_server.url,
            timeout_s=10.0,
            max_retries=3,
            backoff_initial_s=0.01,
            backoff_max_s=5.0,
        )
        values.update(overrides)
        return LLMConfig(**values)

    return make


class Sleeps:
    """The `sleep` the retry policy waits with: records, and can run an action."""

    def __init__(self, action: Callable[[], None] | None = None) -> None:
        self.waits: list[float] = []
        self.action = action

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        if self.action is not None:
            self.action()


def run(
    job: loss.LossJob,
    config: LLMConfig,
    *,
    templates: PromptTemplates | None = None,
    sleep: Callable[[float], None] | None = None,
    **kwargs: Any,
) -> loss.LossResult:
    return loss.run(
        job,
        settings=config,
        templates=templates or PromptTemplates(PROMPTS),
        sleep=sleep or Sleeps(),
        **kwargs,
    )


@pytest.fixture
def window_model() -> Iterator[Callable[[int], str]]:
    """Register an OpenAI-compatible model id with a small known input window
    (litellm.register_model), routed to the loopback server by its openai/ prefix."""
    lm = llm.litellm()
    names: list[str] = []

    def register(window: int) -> str:
        name = f"openai/skilltrain-test-window-{window}"
        lm.register_model(
            {
                name: {
                    "max_input_tokens": window,
                    "max_tokens": window,
                    "max_output_tokens": 1000,
                    "litellm_provider": "openai",
                    "mode": "chat",
                }
            }
        )
        names.append(name)
        return name

    yield register
    for name in names:
        lm.model_cost.pop(name, None)


# --------------------------------------------------------------------------- happy path


def test_report_archive_and_sidecar_are_written_and_the_llm_sees_both_screenplays(
    job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    llm_server.script(Reply.ok(REPORT))

    result = run(job, settings())

    assert job.report_path.read_text(encoding="utf-8") == REPORT + "\n"
    assert job.archive_path.name == "example_ep01-03_prompt.md"
    assert job.sidecar_path.name == "example_ep01-03.json"
    assert job.archive_path.is_file() and job.sidecar_path.is_file()
    assert sorted(p.name for p in job.report_path.parent.iterdir()) == [
        "example_ep01-03.json",
        "example_ep01-03.md",
        "example_ep01-03_prompt.md",
    ]
    assert result.report_path == job.report_path
    assert result.report_bytes == len((REPORT + "\n").encode())
    # The LLM has to see the answer key: that is the comparison.
    assert llm_server.request_count == 1
    request = llm_server.requests[0]
    assert request.model == "loopback-model"
    content = request.messages[0]["content"]
    assert isinstance(content, str)  # the loopback model has no prompt caching
    for text in episode_texts(EXAMPLE / "human") + episode_texts(job.scripts_dir):
        for line in text.splitlines():
            assert line.strip() in content
    assert content.index("=== Human EP 01 ===") < content.index("=== Model EP 01 ===")
    assert result.prompt_chars == len(content)


def test_archive_holds_no_human_line_and_says_what_was_omitted(
    job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    run(job, settings())

    archive = job.archive_path.read_text(encoding="utf-8")
    lines = human_lines()
    assert len(lines) > 50
    assert [line for line in lines if line in archive] == []
    assert "=== Human EP" not in archive
    human = dataset.read_range(EXAMPLE / "human", 1, 3, label="human")
    # Counted as the craft statistics count them (the prompt's facts table).
    words = craft_distance.measure_pair(human, human)[0].words
    assert "[human screenplay omitted from this archive: episodes 01-03, 3 files" in archive
    assert f"{words:,} words" in archive
    assert dataset.episodes_digest(human)[:16] in archive
    # The archive is the prompt otherwise: the model's episodes and the template are there.
    for text in episode_texts(job.scripts_dir):
        for line in text.splitlines():
            assert line.strip() in archive
    assert "You are a script editor." in archive


def test_sidecar_records_inputs_tokens_cost_and_times(
    job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    llm_server.script(Reply.ok(REPORT, cached_tokens=1234))
    before = datetime.now().astimezone()

    result = run(job, settings())

    after = datetime.now().astimezone()
    sidecar = json.loads(job.sidecar_path.read_text(encoding="utf-8"))
    assert sidecar == result.sidecar
    request = llm_server.requests[0]
    human = dataset.read_range(EXAMPLE / "human", 1, 3, label="human")
    model = dataset.read_range(job.scripts_dir, 1, 3, label="model")
    template = hashlib.sha256((PROMPTS / "loss.md.j2").read_bytes()).hexdigest()
    assert sidecar["model"] == "openai/loopback-model"
    assert sidecar["work"] == "example" and sidecar["range"] == "01-03"
    assert (sidecar["first"], sidecar["last"]) == (1, 3)
    assert sidecar["inputs"] == {
        "human_sha256": dataset.episodes_digest(human),
        "model_sha256": dataset.episodes_digest(model),
        "template_sha256": template,
        "model_id": "openai/loopback-model",
    }
    assert sidecar["model_episodes"] == {
        f"ep{n:02d}.txt": hashlib.sha256(model[n].encode()).hexdigest() for n in (1, 2, 3)
    }
    report = job.report_path.read_text(encoding="utf-8")
    assert sidecar["report_sha256"] == hashlib.sha256(report.encode()).hexdigest()
    # Token counts are the server's (chars // 4), not a local estimate.
    assert sidecar["tokens_in"] == request.prompt_chars // 4
    assert sidecar["tokens_out"] == len(REPORT) // 4
    assert sidecar["tokens_cached"] == 1234
    # Not counted locally: litellm knows no window for this model, so there is
    # nothing to check the count against.
    assert sidecar["prompt_tokens"] is result.prompt_tokens is None
    assert sidecar["prompt_chars"] == request.prompt_chars
    assert sidecar["cost_usd"] is None  # unmapped model: unknown, not zero
    assert sidecar["attempts"] == 1
    assert sidecar["finish_reason"] == "stop"
    assert sidecar["leaks_redacted"] == 0
    started = datetime.fromisoformat(sidecar["started_at"])
    finished = datetime.fromisoformat(sidecar["finished_at"])
    assert started.tzinfo is not None
    assert before <= started <= finished <= after
    assert 0 <= sidecar["duration_ms"] <= (after - before).total_seconds() * 1000 + 1
    assert_no_human_text(job.sidecar_path.read_text(encoding="utf-8"))


def test_sidecar_prices_a_mapped_model_from_the_server_usage(
    job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    # A real mapped id, pointed at the loopback server: litellm knows its price.
    llm_server.script(Reply.ok(REPORT, prompt_tokens=10_000, completion_tokens=500))

    run(job, settings(model="openai/gpt-4o-mini"))

    info = llm.litellm().model_cost["gpt-4o-mini"]
    expected = 10_000 * info["input_cost_per_token"] + 500 * info["output_cost_per_token"]
    sidecar = json.loads(job.sidecar_path.read_text(encoding="utf-8"))
    assert (sidecar["tokens_in"], sidecar["tokens_out"]) == (10_000, 500)
    assert sidecar["cost_usd"] == pytest.approx(expected)
    assert llm_server.requests[0].model == "gpt-4o-mini"


def test_second_run_replaces_the_set_and_leaves_no_temp_files(
    tmp_path: Path, job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    llm_server.script(Reply.ok("First report, long enough to be a report."), Reply.ok(REPORT))
    run(job, settings())
    first_sidecar = json.loads(job.sidecar_path.read_text(encoding="utf-8"))
    (job.scripts_dir / "ep02.txt").write_text("INT. ROOM - DAY\n\nA new draft.\n")

    run(job, settings())

    assert job.report_path.read_text(encoding="utf-8") == REPORT + "\n"
    second_sidecar = json.loads(job.sidecar_path.read_text(encoding="utf-8"))
    assert second_sidecar["inputs"]["model_sha256"] != first_sidecar["inputs"]["model_sha256"]
    assert "A new draft." in job.archive_path.read_text(encoding="utf-8")
    assert list(atomic.leftover_temp_files(tmp_path)) == []


# --------------------------------------------------------------------------- leak guard


def test_report_quoting_the_answer_key_is_redacted(
    job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    llm_server.script(Reply.ok(f'{REPORT} The original opens with: "{HUMAN_LINE}" Do that.'))

    result = run(job, settings(), on_leak="redact")

    report = job.report_path.read_text(encoding="utf-8")
    assert leakguard.REDACTION_MARKER in report
    assert "cracked tarmac" not in report
    assert report.startswith(REPORT[:40])
    assert result.leaks_redacted == 1
    assert json.loads(job.sidecar_path.read_text(encoding="utf-8"))["leaks_redacted"] == 1


def test_report_quoting_the_answer_key_is_refused_when_configured(
    tmp_path: Path, job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    llm_server.script(Reply.ok(f'{REPORT} The original opens with: "{HUMAN_LINE}" Do that.'))

    with pytest.raises(RefusedError, match=r"quotes the human screenplay verbatim in 1 place"):
        run(job, settings(), on_leak="refuse")

    assert_nothing_written(job, tmp_path)


@pytest.mark.parametrize("slot", ["{{ model_scripts }}", "{{ model_scripts | upper }}"],
                         ids=["verbatim", "filtered"])
def test_answer_key_passage_across_the_seam_of_template_and_model_block_is_refused(
    tmp_path: Path, work_copy: Path, job: loss.LossJob, settings: SettingsFactory, slot: str
) -> None:
    """The archive check skips the model block but not its edges: a human line
    made of the template's last words before the block, the block's header and
    its first words is in no one piece, and still in the archive."""
    ep01 = work_copy / "human" / "ep01.txt"
    ep01.write_text(ep01.read_text(encoding="utf-8")
                    + "\nUp close, the stencil says MODEL EP 01 FERRY LINE in red.\n",
                    encoding="utf-8")
    first = job.scripts_dir / "ep01.txt"
    first.write_text("FERRY LINE in red.\n\n" + first.read_text(encoding="utf-8"),
                     encoding="utf-8")
    templates = _template_copy(tmp_path, "{{ model_scripts }}",
                               "Up close, the stencil says\n\n" + slot)
    seam = loss.LossJob(work=dataset.load_work(work_copy), scripts_dir=job.scripts_dir,
                        report_path=job.report_path, first=1, last=3)

    with pytest.raises(RefusedError, match="outside human_scripts"):
        run(seam, settings(), templates=templates)

    assert_nothing_written(seam, tmp_path)


def test_model_block_opening_with_a_line_of_the_key_is_archived(
    job: loss.LossJob, settings: SettingsFactory
) -> None:
    """The model's own text may say what the key says (a shared scene heading,
    a line both writers wrote): at the block's edge, beside the template's
    text, it is allowed as the block's text, not refused as the template's."""
    first = job.scripts_dir / "ep01.txt"
    first.write_text(f"{HUMAN_LINE}\n\n" + first.read_text(encoding="utf-8"), encoding="utf-8")

    run(job, settings())

    assert HUMAN_LINE in job.archive_path.read_text(encoding="utf-8")


# --------------------------------------------------------------------------- input refusals


def _missing_range(scripts: Path) -> None:
    for n in (1, 2, 3):
        (scripts / f"ep{n:02d}.txt").unlink()


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    def breakage(scripts: Path) -> None:
        (scripts / name).write_bytes(data)

    return breakage


def _unlink_ep02(scripts: Path) -> None:
    (scripts / "ep02.txt").unlink()


def _directory_ep02(scripts: Path) -> None:
    (scripts / "ep02.txt").unlink()
    (scripts / "ep02.txt").mkdir()
    (scripts / "ep02.txt" / "scene.txt").write_text("INT. ROOM - DAY\n")


def _symlink_to_answer_key(scripts: Path) -> None:
    # The worst symlink there is: the "draft" is the answer key itself.
    (scripts / "ep02.txt").unlink()
    (scripts / "ep02.txt").symlink_to(EXAMPLE / "human" / "ep02.txt")


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (_missing_range, r"^no model episodes 1-3 in .*/scripts$"),
        (_unlink_ep02, r"^model episode ep02\.txt is missing in .*/scripts$"),
        (_write("ep02.txt", b""), r"ep02\.txt is empty \(0 bytes\)$"),
        (_write("ep02.txt", b" \n\t\n  \n"), r"ep02\.txt is empty \(no letter or digit: "),
        (_write("ep02.txt", "\ufeff\n".encode()), r"ep02\.txt is empty \(no letter or digit: "),
        (_write("ep02.txt", "\u200b\u2060\u200c \u200d\n".encode()),
         r"ep02\.txt is empty \(no letter or digit: "),
        (
            _write("ep02.txt", b"INT. ROOM - DAY\n\nCaf\xe9 au lait.\n"),
            r"ep02\.txt is not valid UTF-8 \(byte 20\)$",
        ),
        (_directory_ep02, r"ep02\.txt is not a regular file$"),
        (_symlink_to_answer_key, r"ep02\.txt leads into the answer key \(.*\); not followed$"),
    ],
    ids=[
        "range-missing",
        "one-missing",
        "empty",
        "whitespace",
        "bom-only",
        "zero-width-only",
        "not-utf8",
        "directory",
        "symlink-out",
    ],
)
def test_bad_model_episode_is_refused_before_any_request_and_nothing_is_written(
    tmp_path: Path,
    job: loss.LossJob,
    settings: SettingsFactory,
    llm_server: LLMServer,
    breakage: Callable[[Path], None],
    message: str,
) -> None:
    breakage(job.scripts_dir)

    with pytest.raises(RefusedError, match=message) as caught:
        run(job, settings(), confine_to=tmp_path / "runs")

    assert llm_server.request_count == 0
    assert_nothing_written(job, tmp_path)
    assert_no_human_text(str(caught.value))


def test_symlink_inside_the_runs_root_is_followed(
    tmp_path: Path, job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    # The control for the refusal above: confinement refuses what leaves the root only.
    elsewhere = tmp_path / "runs" / "r1" / "shared" / "ep02.txt"
    elsewhere.parent.mkdir()
    (job.scripts_dir / "ep02.txt").rename(elsewhere)
    (job.scripts_dir / "ep02.txt").symlink_to(elsewhere)

    run(job, settings(), confine_to=tmp_path / "runs")

    assert elsewhere.read_text(encoding="utf-8") in llm_server.requests[0].messages[0]["content"]


def test_dangling_symlink_inside_the_root_is_refused(
    tmp_path: Path, job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    (job.scripts_dir / "ep02.txt").unlink()
    (job.scripts_dir / "ep02.txt").symlink_to(tmp_path / "runs" / "deleted.txt")

    with pytest.raises(RefusedError, match=r"ep02\.txt"):
        run(job, settings(), confine_to=tmp_path / "runs")
    assert llm_server.request_count == 0
    assert_nothing_written(job, tmp_path)


def test_symlink_loop_is_refused(
    tmp_path: Path, job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    (job.scripts_dir / "ep02.txt").unlink()
    (job.scripts_dir / "ep02.txt").symlink_to("ep02.txt")

    with pytest.raises(RefusedError, match=r"ep02\.txt"):
        run(job, settings(), confine_to=tmp_path / "runs")
    assert_nothing_written(job, tmp_path)


def test_a_link_out_of_runs_is_refused_whatever_file_it_reaches(
    tmp_path: Path, job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    # The symlink-out case above reaches a human episode, which the copy check
    # refuses too. Here the target is the writer's own draft, only kept out of
    # runs/: nothing but the confinement to runs/ stands between it and the model.
    outside = tmp_path / "elsewhere" / "ep02.txt"
    outside.parent.mkdir()
    (job.scripts_dir / "ep02.txt").rename(outside)
    (job.scripts_dir / "ep02.txt").symlink_to(outside)

    with pytest.raises(RefusedError, match=r"ep02\.txt is a symlink out of runs/; not followed$"):
        run(job, settings(), confine_to=tmp_path / "runs")
    assert llm_server.request_count == 0
    assert_nothing_written(job, tmp_path)


@pytest.mark.parametrize("where", ["out of runs", "into the answer key",
                                   "into an answer key kept in runs", "inside runs"])
def test_a_scripts_folder_that_is_a_link_is_confined_as_a_whole(
    tmp_path: Path, job: loss.LossJob, work_copy: Path, settings: SettingsFactory,
    llm_server: LLMServer, where: str
) -> None:
    # The folder is opened and what the kernel opened is checked (dataset.
    # open_confined): its files are then read in it, not confined one by one.
    # The target holds the writer's own draft, no copy of a human episode, so
    # only the folder's confinement can refuse it.
    if where == "into an answer key kept in runs":  # only the answer-key rule refuses
        work_copy = shutil.copytree(work_copy, tmp_path / "runs" / "data" / "example")
    target = {"out of runs": tmp_path / "elsewhere",
              "inside runs": tmp_path / "runs" / "r1" / "shared"}.get(
                  where, work_copy / "human" / "drafts")
    shutil.copytree(job.scripts_dir, target)
    shutil.rmtree(job.scripts_dir)
    job.scripts_dir.symlink_to(target, target_is_directory=True)
    job = loss.LossJob(work=dataset.load_work(work_copy), scripts_dir=job.scripts_dir,
                       report_path=job.report_path, first=1, last=3)

    if where == "inside runs":
        run(job, settings(), confine_to=tmp_path / "runs")
        assert llm_server.request_count == 1
        return
    refused = (r"scripts is a symlink out of runs/; not followed$" if where == "out of runs"
               else r"scripts leads into the answer key \(.*\); not followed$")
    with pytest.raises(RefusedError, match=refused):
        run(job, settings(), confine_to=tmp_path / "runs")
    assert llm_server.request_count == 0
    assert_nothing_written(job, tmp_path)


def test_a_link_into_the_answer_key_is_refused_whatever_file_it_reaches(
    tmp_path: Path, work_copy: Path, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    # The answer key's folder holds more than its episodes (a draft of the
    # human writer, notes): a link into it is refused for where it leads, not
    # for what the file holds. These are no copies of a human episode, and the
    # scripts folder is a link the way `skilltrain loss --scripts` may get one
    # (no runs/ root to confine to): only the answer-key rule refuses them.
    drafts = work_copy / "human" / "drafts"
    drafts.mkdir()
    for n in (1, 2, 3):
        shutil.copy(EXAMPLE / "model_draft" / f"ep{n:02d}.txt", drafts)
    linked = tmp_path / "scripts"
    linked.symlink_to(drafts, target_is_directory=True)
    job = loss.LossJob(work=dataset.load_work(work_copy), scripts_dir=linked,
                       report_path=tmp_path / "out" / "example_ep01-03.md", first=1, last=3)

    into_the_key = r"ep01\.txt leads into the answer key \(.*\); not followed$"
    with pytest.raises(RefusedError, match=into_the_key):
        run(job, settings())
    assert llm_server.request_count == 0
    assert_nothing_written(job, tmp_path)


def _human_range_missing(human: Path) -> None:
    for n in (1, 2, 3):
        (human / f"ep{n:02d}.txt").unlink()


def _human_ep02_empty(human: Path) -> None:
    (human / "ep02.txt").write_bytes(b"")


def _human_ep03_missing(human: Path) -> None:
    (human / "ep03.txt").unlink()


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (_human_range_missing, r"^no human episodes 1-3 in .*/data/example/human$"),
        (_human_ep02_empty, r"^human episode .*/human/ep02\.txt is empty \(0 bytes\)$"),
        (_human_ep03_missing, r"^human episode ep03\.txt is missing in .*/human$"),
    ],
    ids=["range-missing", "empty", "one-missing"],
)
def test_bad_human_episode_is_refused_and_nothing_is_written(
    tmp_path: Path,
    work_copy: Path,
    job: loss.LossJob,
    settings: SettingsFactory,
    llm_server: LLMServer,
    breakage: Callable[[Path], None],
    message: str,
) -> None:
    breakage(work_copy / "human")
    broken = loss.LossJob(
        work=dataset.load_work(work_copy),
        scripts_dir=job.scripts_dir,
        report_path=job.report_path,
        first=1,
        last=3,
    )

    with pytest.raises(RefusedError, match=message):
        run(broken, settings())

    assert llm_server.request_count == 0
    assert_nothing_written(broken, tmp_path)


def test_oversized_episode_is_refused_from_its_size_before_it_is_read(
    tmp_path: Path,
    job: loss.LossJob,
    settings: SettingsFactory,
    llm_server: LLMServer,
    window_model: Callable[[int], str],
) -> None:
    model = window_model(1_000)  # 1,000 tokens * 16 bytes = a 16,000-byte limit
    # Not UTF-8: had the file been read before its size was checked, the refusal
    # would be about the encoding.
    (job.scripts_dir / "ep02.txt").write_bytes(b"\xff" * 20_000)

    with pytest.raises(RefusedError) as caught:
        run(job, settings(model=model))

    text = str(caught.value)
    assert "ep02.txt" in text
    assert "20,000 bytes" in text
    assert re.search(r"over the [\d,]+-byte limit", text), text
    assert llm_server.request_count == 0
    assert_nothing_written(job, tmp_path)


def test_prompt_over_the_model_window_is_refused_with_the_numbers(
    tmp_path: Path,
    job: loss.LossJob,
    settings: SettingsFactory,
    llm_server: LLMServer,
    window_model: Callable[[int], str],
) -> None:
    model = window_model(8_000)  # the example's ep01-03 prompt is ~6,000 tokens + 4,096 reserve

    with pytest.raises(RefusedError) as caught:
        run(job, settings(model=model))

    text = str(caught.value)
    found = re.search(r"^prompt for example ep01-03 is ([\d,]+) tokens; ", text)
    assert found, text
    tokens = int(found.group(1).replace(",", ""))
    assert 8_000 - loss.OUTPUT_RESERVE_TOKENS < tokens < 8_000
    assert f"{model} accepts 8,000 input tokens (with 4,096 kept for the report)" in text
    assert llm_server.request_count == 0
    assert_nothing_written(job, tmp_path)


def test_prompt_inside_the_model_window_is_sent(
    job: loss.LossJob,
    settings: SettingsFactory,
    llm_server: LLMServer,
    window_model: Callable[[int], str],
) -> None:
    # The control for the two refusals above: a window that fits lets the job through.
    run(job, settings(model=window_model(20_000)))

    assert llm_server.request_count == 1
    assert job.report_path.is_file()


def test_a_models_window_follows_its_registration() -> None:
    # max_input_tokens keeps "unknown" to spare litellm's search of its map on
    # every job: a model registered later, again with another window, or taken
    # out of the map is seen at once.
    lm = llm.litellm()
    name = "openai/skilltrain-test-window-later"
    info = {"max_tokens": 1, "litellm_provider": "openai", "mode": "chat"}
    try:
        assert llm.max_input_tokens(name) is None
        assert llm.max_input_tokens(name) is None  # kept as unknown
        for window in (1_000, 2_000, 3_000, 4_000):
            lm.register_model({name: {**info, "max_input_tokens": window}})
            assert llm.max_input_tokens(name) == window
    finally:
        lm.model_cost.pop(name, None)
    assert llm.max_input_tokens(name) is None


def test_a_prompt_that_may_not_fit_by_its_bytes_is_counted_exactly(
    job: loss.LossJob,
    settings: SettingsFactory,
    llm_server: LLMServer,
    window_model: Callable[[int], str],
) -> None:
    # ~6,000 tokens in ~24,000 bytes: over a 12,000-token window by its bytes,
    # inside it by its tokens. Only the exact count lets it through.
    result = run(job, settings(model=window_model(12_000)))
    assert llm_server.requests[0].prompt_chars + loss.OUTPUT_RESERVE_TOKENS > 12_000
    assert result.prompt_tokens is not None
    assert result.prompt_tokens + loss.OUTPUT_RESERVE_TOKENS <= 12_000
    assert result.sidecar["prompt_tokens"] == result.prompt_tokens


def test_a_prompt_that_fits_by_its_bytes_is_not_counted(
    job: loss.LossJob,
    settings: SettingsFactory,
    llm_server: LLMServer,
    window_model: Callable[[int], str],
) -> None:
    # Bytes + reserve inside the window: no tokenizer can make it too long.
    result = run(job, settings(model=window_model(1_000_000)))

    assert llm_server.request_count == 1
    assert result.prompt_tokens is None and result.sidecar["prompt_tokens"] is None


# --------------------------------------------------------------------------- output refusals


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (Reply.empty(), r"^the model returned an empty report for example ep01-03 \(no "),
        (Reply.ok(" \n\n \t"), r"^the model returned an empty report for example ep01-03 \(no "),
        (Reply.ok("\u200b\u200b\ufeff\u2060\n"), r"empty report for example ep01-03 \(no "),
        (Reply.ok(REPORT + " \ud800 " + REPORT), r"is not prose: a lone surrogate U\+D800 at "),
        (
            Reply.truncated(),
            r"^the report for example ep01-03 was cut off \(finish_reason=length, \d+ tokens out",
        ),
        (
            Reply.ok(REPORT, finish_reason="content_filter"),
            r"was cut off \(finish_reason=content_filter",
        ),
    ],
    ids=["empty", "whitespace", "invisible-only", "lone-surrogate", "truncated", "content-filter"],
)
def test_empty_or_cut_off_report_is_refused_and_nothing_is_written(
    tmp_path: Path,
    job: loss.LossJob,
    settings: SettingsFactory,
    llm_server: LLMServer,
    reply: Reply,
    message: str,
) -> None:
    llm_server.script(reply)

    with pytest.raises(RefusedError, match=message):
        run(job, settings())

    assert llm_server.request_count == 1  # not retried: the same prompt gives the same cut
    assert_nothing_written(job, tmp_path)


def test_a_reply_that_does_not_say_it_ended_is_refused(
    tmp_path: Path, job: loss.LossJob, settings: SettingsFactory
) -> None:
    # litellm says "stop" for a live reply with no finish_reason; a provider
    # batch's result file is read by our own code, and a missing reason there
    # must not pass for a complete report.
    prepared = loss.prepare(job, settings=settings(), templates=PromptTemplates(PROMPTS))
    completion = llm.Completion(text=REPORT, finish_reason=None, tokens_in=100, tokens_out=50,
                                tokens_cached=0, cost_usd=None, attempts=1)
    with pytest.raises(RefusedError, match=r"does not say it is complete \(no finish_reason\)"):
        loss.finish(prepared, completion)
    assert_nothing_written(job, tmp_path)


# --------------------------------------------------------------------------- faults and retries


def test_429_waits_at_least_as_long_as_retry_after_then_succeeds(
    job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    llm_server.script(Reply.status(429, retry_after=3), Reply.ok(REPORT))
    sleeps = Sleeps()
    retries: list[tuple[int, float, str]] = []

    result = run(
        job,
        settings(),
        sleep=sleeps,
        hooks=loss.LossHooks(retry=lambda n, wait, e: retries.append((n, wait, type(e).__name__))),
    )

    assert llm_server.request_count == 2
    assert len(sleeps.waits) == 1
    # backoff alone would be at most 0.01 s: the 3 s come from the header.
    assert sleeps.waits[0] >= 3.0
    assert retries == [(1, sleeps.waits[0], "RetryableError")]
    assert result.completion.attempts == 2
    assert json.loads(job.sidecar_path.read_text(encoding="utf-8"))["attempts"] == 2
    assert job.report_path.read_text(encoding="utf-8") == REPORT + "\n"


def test_retry_after_is_capped_at_backoff_max(
    job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    llm_server.script(Reply.status(429, retry_after=3600), Reply.ok(REPORT))
    sleeps = Sleeps()

    run(job, settings(backoff_max_s=2.0), sleep=sleeps)

    assert sleeps.waits == [2.0]


def test_retry_after_is_waited_for_real_with_the_default_sleep(
    job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    llm_server.script(Reply.status(429, retry_after=0.3), Reply.ok(REPORT))

    run(job, settings(), sleep=time.sleep)

    first, second = llm_server.requests
    assert second.monotonic - first.monotonic >= 0.3
    assert job.report_path.is_file()


@pytest.mark.parametrize(
    "failure",
    [
        Reply.status(500),
        Reply.status(502),
        Reply.status(503),
        Reply.status(504),
        Reply.status(529),
        Reply.malformed(),
    ],
    ids=["500", "502", "503", "504", "529", "malformed"],
)
def test_transient_failure_is_retried_and_the_report_written(
    tmp_path: Path,
    job: loss.LossJob,
    settings: SettingsFactory,
    llm_server: LLMServer,
    failure: Reply,
) -> None:
    llm_server.script(failure, failure, Reply.ok(REPORT))
    sleeps = Sleeps()

    result = run(job, settings(), sleep=sleeps)

    assert llm_server.request_count == 3
    assert len(sleeps.waits) == 2
    assert all(0 <= w <= 0.02 for w in sleeps.waits)  # full jitter under the ceiling
    assert result.completion.attempts == 3
    assert job.report_path.read_text(encoding="utf-8") == REPORT + "\n"
    assert list(atomic.leftover_temp_files(tmp_path)) == []


def test_request_hanging_past_the_timeout_is_abandoned_and_retried(
    job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    llm_server.script(Reply.hang(30), Reply.ok(REPORT))
    t0 = time.monotonic()

    result = run(job, settings(timeout_s=0.5))

    elapsed = time.monotonic() - t0
    assert llm_server.request_count == 2
    assert result.completion.attempts == 2
    # [llm] timeout bounds the whole call, litellm's own work before the first
    # byte included: the hung attempt took the 0.5 s, the retry came soon after.
    assert 0.5 <= elapsed < 10
    assert llm_server.requests[1].monotonic - llm_server.requests[0].monotonic < 5
    assert job.report_path.read_text(encoding="utf-8") == REPORT + "\n"


def test_server_down_then_back_is_recovered(
    job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    config = settings()  # the URL is fixed while the server is up
    llm_server.script(Reply.ok(REPORT))  # scripted replies survive a restart
    llm_server.stop()

    def bring_back() -> None:
        if not llm_server.running:
            llm_server.start()

    sleeps = Sleeps(action=bring_back)

    result = run(job, config, sleep=sleeps)

    assert len(sleeps.waits) == 1  # the refused connection cost one retry
    assert result.completion.attempts == 2
    assert llm_server.request_count == 1
    assert job.report_path.read_text(encoding="utf-8") == REPORT + "\n"


def test_exhausted_retries_raise_llm_error_and_write_nothing(
    tmp_path: Path, job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    llm_server.default = lambda request: Reply.status(503)
    sleeps = Sleeps()

    with pytest.raises(LLMError, match=r"^gave up after 3 attempts: ServiceUnavailableError"):
        run(job, settings(max_retries=2), sleep=sleeps)

    assert llm_server.request_count == 3
    assert len(sleeps.waits) == 2
    # Each attempt is one request: neither the OpenAI SDK nor litellm retried inside it.
    assert [r.headers.get("x-stainless-retry-count") for r in llm_server.requests] == ["0"] * 3
    assert_nothing_written(job, tmp_path)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (400, "BadRequestError"),
        (401, "AuthenticationError"),
        (403, "APIError"),
        (404, "NotFoundError"),
        (422, "BadRequestError"),
    ],
)
def test_client_errors_are_not_retried(
    tmp_path: Path,
    job: loss.LossJob,
    settings: SettingsFactory,
    llm_server: LLMServer,
    code: int,
    kind: str,
) -> None:
    llm_server.script(Reply.status(code))
    sleeps = Sleeps()

    with pytest.raises(LLMError, match=rf"^{kind} \(HTTP {code}\)"):
        run(job, settings(), sleep=sleeps)

    assert llm_server.request_count == 1
    assert sleeps.waits == []
    assert_nothing_written(job, tmp_path)


def test_provider_error_echoing_the_prompt_does_not_carry_human_text(
    job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    body = {
        "error": {
            "message": f"flagged by content policy: '{HUMAN_LINE}'",
            "type": "invalid_request_error",
            "code": "content_policy_violation",
        }
    }
    llm_server.script(Reply.status(400, body=body))

    with pytest.raises(LLMError) as caught:
        run(job, settings())

    assert_no_human_text(str(caught.value))


# --------------------------------------------------------------------------- atomicity


@pytest.mark.parametrize(
    "crash",
    [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
    ids=["disk-full", "interrupt"],
)
def test_crash_while_replacing_the_report_keeps_the_old_set_whole(
    tmp_path: Path,
    job: loss.LossJob,
    settings: SettingsFactory,
    llm_server: LLMServer,
    monkeypatch: pytest.MonkeyPatch,
    crash: BaseException,
) -> None:
    llm_server.script(Reply.ok("The old report, complete."), Reply.ok(REPORT))
    run(job, settings())
    old_report = job.report_path.read_bytes()
    old_sidecar = job.sidecar_path.read_bytes()
    real_replace = os.replace

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(dst) == job.report_path:
            raise crash
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)

    with pytest.raises(type(crash)):
        run(job, settings())

    assert job.report_path.read_bytes() == old_report
    # The sidecar is written last, so it still describes the old report.
    assert job.sidecar_path.read_bytes() == old_sidecar
    assert json.loads(old_sidecar)["report_sha256"] == hashlib.sha256(old_report).hexdigest()
    assert list(atomic.leftover_temp_files(tmp_path)) == []


# --------------------------------------------------------------------------- templates


def _template_copy(tmp_path: Path, old: str = "", new: str = "") -> PromptTemplates:
    folder = tmp_path / "prompts"
    folder.mkdir(exist_ok=True)
    source = (PROMPTS / "loss.md.j2").read_text(encoding="utf-8")
    if old:
        assert old in source
        source = source.replace(old, new, 1)
    (folder / "loss.md.j2").write_text(source, encoding="utf-8")
    return PromptTemplates(folder)


FIELDS = dict(
    work="example",
    title="Low Water",
    episode_range="1-3",
    human_scripts=HUMAN_LINE,
    model_scripts="=== Model EP 01 ===\n\nINT. ROOM - DAY",
)


def test_misspelt_template_variable_is_a_config_error_naming_it(
    tmp_path: Path, job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    templates = _template_copy(tmp_path, "{{ human_scripts }}", "{{ human_scripst }}")

    with pytest.raises(ConfigError) as caught:
        run(job, settings(), templates=templates)

    text = str(caught.value)
    assert "'human_scripst' is undefined" in text
    assert str(tmp_path / "prompts" / "loss.md.j2") in text
    assert "\n" not in text
    assert llm_server.request_count == 0
    assert_nothing_written(job, tmp_path)


def test_template_syntax_error_names_the_line(tmp_path: Path) -> None:
    templates = _template_copy(tmp_path, "## The model's screenplay", "{% if %}")
    line = 1 + (tmp_path / "prompts" / "loss.md.j2").read_text().splitlines().index("{% if %}")

    with pytest.raises(ConfigError, match=rf"loss\.md\.j2, line {line}: ") as caught:
        templates.check("loss")
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=rf"line {line}"):
        templates.render("loss", **FIELDS)


def test_missing_template_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"template .*/nowhere/loss\.md\.j2 not found"):
        PromptTemplates(tmp_path / "nowhere").render("loss", **FIELDS)


def test_template_edit_applies_to_the_next_render_without_a_restart(tmp_path: Path) -> None:
    templates = _template_copy(tmp_path)
    path = tmp_path / "prompts" / "loss.md.j2"
    assert templates.render("loss", **FIELDS).startswith("You are a script editor.")
    hash_before = templates.source_hash("loss")

    path.write_text("EDITED {{ title }}\n{{ human_scripts }}\n{{ model_scripts }}\n")
    # An edit by a person comes later than the last render: move mtime on, as time would.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))

    assert templates.render("loss", **FIELDS).startswith("EDITED Low Water")
    assert templates.source_hash("loss") != hash_before


def test_template_edit_within_one_mtime_tick_is_rendered(tmp_path: Path) -> None:
    templates = _template_copy(tmp_path)
    path = tmp_path / "prompts" / "loss.md.j2"
    templates.render("loss", **FIELDS)
    st = path.stat()

    path.write_text("EDITED {{ title }}\n{{ human_scripts }}\n{{ model_scripts }}\n")
    # A coarse-timestamp filesystem (or a fast script) gives the edit the same mtime.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    rendered = templates.render("loss", **FIELDS)
    assert templates.source_hash("loss") == hashlib.sha256(path.read_bytes()).hexdigest()
    assert rendered.startswith("EDITED Low Water")


def test_template_edit_between_jobs_changes_the_prompt_and_the_sidecar_hash(
    tmp_path: Path, job: loss.LossJob, settings: SettingsFactory, llm_server: LLMServer
) -> None:
    templates = _template_copy(tmp_path)
    run(job, settings(), templates=templates)
    first_hash = json.loads(job.sidecar_path.read_text())["inputs"]["template_sha256"]
    path = tmp_path / "prompts" / "loss.md.j2"
    path.write_text(path.read_text().replace("You are a script editor.", "You are a dramaturg."))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))

    run(job, settings(), templates=templates)

    first, second = (r.messages[0]["content"] for r in llm_server.requests)
    assert first.startswith("You are a script editor.")
    assert second.startswith("You are a dramaturg.")
    sidecar = json.loads(job.sidecar_path.read_text())
    assert sidecar["inputs"]["template_sha256"] != first_hash
    assert sidecar["inputs"]["template_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert job.archive_path.read_text().startswith("You are a dramaturg.")


@pytest.mark.parametrize(
    "expression",
    ["{{ human_scripts + 1 }}", "{{ '%d' % human_scripts }}", "{{ human_scripts | int / 0 }}"],
)
def test_render_error_names_kind_and_line_without_human_text(
    tmp_path: Path, expression: str
) -> None:
    templates = _template_copy(tmp_path, "{{ human_scripts }}", expression)
    source = (tmp_path / "prompts" / "loss.md.j2").read_text().splitlines()
    line = 1 + next(i for i, text in enumerate(source) if expression in text)

    with pytest.raises(ConfigError, match=rf"line {line}: render failed \(\w+\)$") as caught:
        templates.render("loss", **FIELDS)

    assert "cracked tarmac" not in str(caught.value)


@pytest.mark.parametrize(
    "expression",
    ["{{ human_scripts[human_scripts] }}", "{% set notes = {} %}{{ notes[human_scripts] }}"],
    ids=["str-index", "dict-key"],
)
def test_undefined_error_message_carries_no_human_text(tmp_path: Path, expression: str) -> None:
    templates = _template_copy(tmp_path, "{{ human_scripts }}", expression)

    with pytest.raises(ConfigError) as caught:
        templates.render("loss", **FIELDS)

    assert "cracked tarmac" not in str(caught.value)


# --------------------------------------------------------------------------- prompt caching layout


def _prompt_and_model_block() -> tuple[str, str]:
    from skilltrain.daemon.reviewer import craft_prompt

    human = dataset.read_range(EXAMPLE / "human", 1, 3, label="human")
    model = dataset.read_range(EXAMPLE / "model_draft", 1, 3, label="model")
    model_block = craft_prompt.format_episodes("Model", model)
    prompt = PromptTemplates(PROMPTS).render(
        "loss",
        work="example",
        title="Low Water",
        episode_range="1-3",
        human_scripts=craft_prompt.format_episodes("Human", human),
        model_scripts=model_block,
    )
    return prompt, model_block


def test_rendered_prompt_puts_the_human_screenplay_before_the_models_episodes() -> None:
    prompt, model_block = _prompt_and_model_block()

    human_start = prompt.index("=== Human EP 01 ===")
    human_end = prompt.index("=== End Human episodes ===")
    model_start = prompt.index(model_block)
    assert human_start < human_end < model_start
    # Nothing that varies per epoch sits above the model's block: only the range does.
    assert "=== Model EP" not in prompt[:model_start]


def test_loopback_model_gets_one_plain_string_message() -> None:
    prompt, model_block = _prompt_and_model_block()

    assert loss.build_messages(prompt, model_block, "openai/loopback-model") == [
        {"role": "user", "content": prompt}
    ]


def test_caching_model_gets_the_stable_prefix_marked_cacheable() -> None:
    prompt, model_block = _prompt_and_model_block()

    messages = loss.build_messages(prompt, model_block, "anthropic/claude-sonnet-4-5")

    assert len(messages) == 1 and messages[0]["role"] == "user"
    prefix, rest = messages[0]["content"]
    assert prefix["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in rest
    assert prefix["text"] + rest["text"] == prompt
    assert "=== End Human episodes ===" in prefix["text"]
    assert rest["text"].startswith(model_block)


# ------------------------------------------------------------ grounded reports (issue 25)

# The example ep01-03, measured: the model's speeches run 21.8 words against 5.2,
# its scenes are fewer (2.7 against 6.3 per episode).
WRONG_CLAIMS = (f"{REPORT}\n\n## Claims\n\n- speech_words_mean: lower\n"
                "- scenes_per_episode: lower\n- dialogue_share: similar\n")


def test_the_prompt_shows_both_sides_facts_human_before_the_models_episodes(
        job: loss.LossJob, llm_server: LLMServer, settings: SettingsFactory) -> None:
    llm_server.script(Reply.ok(REPORT))
    run(job, settings())
    prompt = llm_server.requests[0].messages[0]["content"]
    human_table = prompt.index("Measured statistics of the human screenplay")
    model_block = prompt.index("=== Model EP 01 ===")
    model_table = prompt.index("Measured statistics of the model's screenplay")
    assert human_table < model_block < model_table
    assert "| `speech_words_mean` | Words per speech (mean) | 5.2 |" in prompt[:model_block]
    assert "| `speech_words_mean` | Words per speech (mean) | 21.8 |" in prompt[model_table:]
    assert "## Claims" in prompt  # the reviewer is asked for the list
    archive = job.archive_path.read_text(encoding="utf-8")
    assert "| `speech_words_mean` | Words per speech (mean) | 5.2 |" in archive
    assert_no_human_text(archive)


def test_annotate_appends_the_measured_facts_and_the_sidecar_keeps_each_verdict(
        job: loss.LossJob, llm_server: LLMServer, settings: SettingsFactory) -> None:
    llm_server.script(Reply.ok(WRONG_CLAIMS))
    result = run(job, settings())  # annotate is the default
    report = job.report_path.read_text(encoding="utf-8")
    assert report.startswith(REPORT) and "- speech_words_mean: lower" in report
    facts = report[report.index("## Measured facts"):]
    assert "`speech_words_mean`" in facts and "model 21.8 against human 5.2" in facts
    assert "`dialogue_share`" in facts and "scenes_per_episode" not in facts
    claims = json.loads(job.sidecar_path.read_text("utf-8"))["claims"]
    assert (claims["status"], claims["confirmed"], claims["contradicted"]) == ("checked", 1, 2)
    speech = next(v for v in claims["verdicts"] if v["statistic"] == "speech_words_mean")
    assert speech["verdict"] == "contradicted" and speech["measured"] == "higher"
    assert speech["human"] == pytest.approx(5.25)
    assert speech["model"] == pytest.approx(21.7727, 1e-4)
    assert result.claims.event_fields()["claims_contradicted_share"] == pytest.approx(0.6667)


def test_refuse_writes_nothing_when_too_many_claims_are_contradicted(
        job: loss.LossJob, llm_server: LLMServer, settings: SettingsFactory) -> None:
    from skilltrain.daemon.core.errors import BadOutputError, ContradictedReportError

    llm_server.script(Reply.ok(WRONG_CLAIMS))
    with pytest.raises(ContradictedReportError) as caught:
        run(job, settings(), on_contradiction="refuse", refuse_share=0.5)
    assert isinstance(caught.value, BadOutputError)  # retried like a bad reply
    assert "2 of 3 checked" in str(caught.value) and "speech_words_mean" in str(caught.value)
    assert caught.value.counts["claims_contradicted"] == 2
    assert_nothing_written(job, job.report_path.parents[3])
    # Under the share it is written, annotated: a contradicted claim never passes unseen.
    llm_server.script(Reply.ok(WRONG_CLAIMS))
    run(job, settings(), on_contradiction="refuse", refuse_share=0.7)
    assert "## Measured facts" in job.report_path.read_text(encoding="utf-8")


def test_ignore_and_a_report_without_claims_are_written_as_they_are(
        job: loss.LossJob, llm_server: LLMServer, settings: SettingsFactory) -> None:
    llm_server.script(Reply.ok(WRONG_CLAIMS))
    run(job, settings(), on_contradiction="ignore")
    assert job.report_path.read_text(encoding="utf-8") == WRONG_CLAIMS
    assert json.loads(job.sidecar_path.read_text("utf-8"))["claims"]["contradicted"] == 2
    llm_server.script(Reply.ok(REPORT))
    result = run(job, settings(), on_contradiction="refuse", refuse_share=0.0)
    assert result.claims.status == "not_checked"
    assert json.loads(job.sidecar_path.read_text("utf-8"))["claims"]["status"] == "not_checked"


def test_a_malformed_claims_list_is_reported_in_the_sidecar(
        job: loss.LossJob, llm_server: LLMServer, settings: SettingsFactory) -> None:
    llm_server.script(Reply.ok(f"{REPORT}\n\n## Claims\n\nscene_words_mean is long\n"
                               "- speech_words_mean: higher\n"))
    run(job, settings())
    claims = json.loads(job.sidecar_path.read_text("utf-8"))["claims"]
    assert (claims["status"], claims["confirmed"], claims["malformed"]) == ("checked", 1, 1)
    assert claims["malformed_lines"][0]["line"] == 5


def test_the_built_in_reviewer_writes_the_list_and_every_claim_is_confirmed(
        job: loss.LossJob, settings: SettingsFactory) -> None:
    result = run(job, settings(model="builtin/craft-metrics", api_base=None))
    assert "## Claims" in job.report_path.read_text(encoding="utf-8")
    fields = result.claims.event_fields()
    assert fields["claims_status"] == "checked" and fields["claims_confirmed"] >= 10
    assert fields["claims_contradicted"] == 0 and fields["claims_not_checkable"] == 0
