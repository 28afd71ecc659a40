"""Issue 11 end to end: no route carries 8 human words in a row into what the daemon writes.

The answer key is a real screenplay nobody here wrote (tests/corpus), the
reviewer is the loopback LLM misbehaving on purpose, the daemon is the real
one. Every file the daemon wrote (reports, prompt archives, sidecars, state,
the JSON log) is then searched for runs of 8 human words by a check that
shares only the normalisation with the guard (`human_runs`), not its rules.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from skilltrain.daemon.core import textnorm
from skilltrain.daemon.core.errors import RefusedError
from skilltrain.daemon.guard import leakguard
from skilltrain.daemon.infra.state import SetState, StateStore
from tests.corpus import adversarial
from tests.daemon_helpers import (
    DaemonProcess,
    Workspace,
    build_workspace,
    release_llm_clients,
    run_cli,
    run_once_in_process,
    wait_until,
)
from tests.llm_server import LLMServer, Reply, Request

# Same filters as tests/test_bad_input.py: litellm's client cache may drop an
# unclosed keep-alive socket (collected at teardown by release_llm_clients).
pytestmark = [
    pytest.mark.usefixtures("litellm_frozen"),
    pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning"),
    pytest.mark.filterwarnings(
        r"ignore:Exception ignored in. <socket\.socket fd=\d+, family=2:"
        "pytest.PytestUnraisableExceptionWarning"
    ),
]


@pytest.fixture(autouse=True)
def _release_clients() -> Iterator[None]:
    yield
    release_llm_clients()


RUN = 8
KEY = adversarial.key()


def _human_grams() -> set[tuple[str, ...]]:
    """Every 8-word run of every line of the key (any words, stock ones too)."""
    grams = set()
    for text in KEY.values():
        for line in text.splitlines():
            toks = textnorm.tokens(line)
            grams.update(tuple(toks[i : i + RUN]) for i in range(len(toks) - RUN + 1))
    return grams


HUMAN_GRAMS = _human_grams()
# Lines made only of stock words pass by design (leakguard: rule 1); this one is
# in the key and no attack here uses it.
STOCK_ONLY = tuple(textnorm.tokens("Well, you want to know how things went at my job today?"))


def human_runs(text: str) -> list[str]:
    """The 8-word runs of the key in `text`, in any reading."""
    found = []
    for view in textnorm.readings(text):
        toks = view.tokens
        for i in range(len(toks) - RUN + 1):
            gram = tuple(toks[i : i + RUN])
            if gram in HUMAN_GRAMS and " ".join(gram) not in " ".join(STOCK_ONLY):
                found.append(" ".join(gram))
    return found


def written_files(ws: Workspace) -> Iterator[Path]:
    yield ws.log_file
    yield from (p for p in ws.runs.rglob("*") if p.is_file() and "scripts" not in p.parts)


def assert_sealed(ws: Workspace) -> None:
    for path in written_files(ws):
        leaked = human_runs(path.read_text(encoding="utf-8", errors="replace"))
        assert not leaked, f"{path.relative_to(ws.root)}: {leaked[:3]}"


def key_workspace(tmp_path: Path, server: LLMServer, works: int = 1, *,
                  extra: str = "") -> Workspace:
    """Works whose answer key is the corpus screenplay; a finished step of model episodes."""
    names = [f"beauty{i}" for i in range(works)]
    ws = build_workspace(tmp_path / "ws", server.url, works=dict.fromkeys(names, 6),
                         max_attempts=1, extra=extra)
    for name in names:
        for ep, text in KEY.items():
            (ws.data / name / "human" / f"ep{ep:02d}.txt").write_text(text, encoding="utf-8")
    ws.write_step("r1", 0, 0, success=True)
    return ws


def prompt_of(request: Request) -> str:
    return "\n".join(str(m.get("content")) for m in request.messages)


def test_quotes_in_every_disguise_and_from_other_ranges_are_redacted(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # Long lines of common words (class 1), a line of ep05 in the report on
    # ep01-03 (class 2), every encoding (class 3); and one distinctive quote.
    quotes = [*adversarial.LONG_COMMON, adversarial.CROSS_RANGE,
              "Lester thrusts his face directly into a steaming hot shower."]
    disguised = [f(q) for f in adversarial.DISGUISES.values() for q in quotes]
    llm_server.default = lambda request: Reply.ok(
        "The original trusts images.\n\n" + "\n\n".join(
            f"Compare: {text} -- the model explains instead." for text in disguised))
    ws = key_workspace(tmp_path, llm_server)
    assert human_runs(llm_server.default(None).content)  # type: ignore[arg-type]

    run_once_in_process(ws)

    reports = sorted(ws.runs.rglob("*_ep0?-0?.md"))
    assert len(reports) == 2
    marker = "[verbatim answer-key passage removed]"
    cut: dict[str, int] = {}
    for report in reports:
        text = report.read_text(encoding="utf-8")
        compared = text.split("Compare: ")[1:]
        assert len(compared) == len(disguised)
        # Each quote cut once, the prose kept; a quote part plain and part
        # encoded (two disguises) may be cut twice, each part long enough.
        counts = [p.count(marker) for p in compared]
        assert all(1 <= n <= 2 for n in counts)
        assert sum(n == 2 for n in counts) <= 2 * len(quotes)
        assert all("the model explains instead." in p for p in compared)
        cut[report.name] = text.count(marker)
    (done,) = ws.events("loss.completed", range="01-03")
    assert done["leaks_redacted"] == next(n for name, n in cut.items() if "ep01-03" in name)
    assert_sealed(ws)


def test_provider_errors_echoing_the_prompt_never_reach_log_or_state(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # Class 4: an error body that echoes the prompt, upper-cased, pipe-joined,
    # zero-width-joined, JSON-escaped or base64; by 400s (final) and 5xx (retried).
    # By set, not by arrival (the four jobs run at once): the first two sets
    # seen get a 5xx first (retried once), every other request a 400.
    disguise = itertools.cycle(["upper-cased", "pipe-joined", "zero-width-joined",
                                "JSON-escaped", "base64"])
    requests: dict[str, int] = {}
    lock = threading.Lock()

    def echo(request: Request) -> Reply:
        prompt = prompt_of(request)
        with lock:
            requests[prompt] = requests.get(prompt, 0) + 1
            retried = requests[prompt] == 1 and list(requests).index(prompt) < 2
            message = adversarial.error_echoes(prompt)[next(disguise)]
        assert human_runs(message)
        status = (500 if len(requests) % 2 else 503) if retried else 400
        return Reply.status(status, body={"error": {"message": message,
                                                    "type": "invalid_request_error"}})

    llm_server.default = echo
    ws = key_workspace(tmp_path, llm_server, works=2)

    run_once_in_process(ws)

    failed = ws.events("loss.failed")
    assert len(failed) == 4
    assert all("(message withheld: it quotes the prompt)" in e["reason"] for e in failed)
    assert len(ws.events("loss.retry")) == 2
    reasons = [s["reason"] for s in ws.state()["sets"].values()]
    assert len(reasons) == 4 and all("withheld" in r for r in reasons)
    assert_sealed(ws)


def _shared_runs(text: str, phrase: str, n: int = 6) -> list[str]:
    """The n-word runs of `phrase` that `text` holds, in any reading of `text`."""
    words = textnorm.tokens(phrase)
    runs = {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}
    return sorted({" ".join(view.tokens[i : i + n]) for view in textnorm.readings(text)
                   for i in range(len(view.tokens) - n + 1)
                   if tuple(view.tokens[i : i + n]) in runs})


def test_a_provider_error_echoing_the_prompt_is_withheld_not_only_sealed(
        tmp_path: Path, llm_server: LLMServer) -> None:
    """The withholding itself, not the log seal behind it: the provider echoes
    the model's own episode (prompt words that are no part of the key, so no
    seal would catch them), first on a 503 (retried) then on a 400 (final).
    Two sets; the first request's set is retried. Those words are in no event,
    no state row and nowhere in the log."""
    echoes: list[str] = []

    def echo(request: Request) -> Reply:
        prompt = prompt_of(request)
        mark = prompt.index("SETMARK ")
        body = prompt[prompt.index("\n", mark):]  # the model's screenplay, after its mark
        words = " ".join(body.split()[:30])
        echoes.append(words)
        status = 503 if len(echoes) == 1 else 400
        return Reply.status(status, body={"error": {"message": f"Invalid request: {words}",
                                                    "type": "invalid_request_error"}})

    llm_server.default = echo
    ws = key_workspace(tmp_path, llm_server)
    run_once_in_process(ws)

    # Two sets, one retried: three echoes, none of them the key (no seal applies).
    assert len(echoes) == 3 and not any(human_runs(echoed) for echoed in echoes)
    failed, retried = ws.events("loss.failed"), ws.events("loss.retry")
    assert len(failed) == 2 and len(retried) == 1
    for echoed in echoes:
        for e in ws.events():
            assert _shared_runs(json.dumps(e, ensure_ascii=False), echoed) == [], e
        for row in ws.state()["sets"].values():
            assert _shared_runs(row["reason"] or "", echoed) == [], row
        assert _shared_runs(ws.log_file.read_text(encoding="utf-8"), echoed) == []
    # The provider's message is dropped whole, its own first words too.
    assert not any("Invalid request" in json.dumps(e) for e in failed + retried)


def test_library_log_records_carrying_the_prompt_are_redacted(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # Class 5: a library logs the prompt (here from inside the request, as
    # litellm does when it warns about a reply), and the provider puts the
    # prompt in finish_reason, which litellm passes on.
    def chatty(request: Request) -> Reply:
        prompt = prompt_of(request)
        logging.getLogger("LiteLLM").warning("unexpected reply for: %s", prompt)
        logging.getLogger("httpx").info("request %s", json.dumps(prompt[-3000:]))
        echo = adversarial.error_echoes(prompt)["upper-cased"].lower()
        return Reply.ok("A report.", finish_reason=echo)

    llm_server.default = chatty
    ws = key_workspace(tmp_path, llm_server)

    run_once_in_process(ws)

    # litellm maps the unknown finish_reason to "stop", warning with its text.
    assert len(ws.events("loss.completed")) == 2
    library = [e for e in ws.events() if e.get("logger") == "LiteLLM"]
    assert sorted(e["event"].split(" ")[0] for e in library) == [
        "Unmapped", "Unmapped", "unexpected", "unexpected"]
    assert all("[verbatim answer-key passage removed]" in e["event"] for e in library)
    assert_sealed(ws)


def test_debug_level_logs_no_prompt_or_reply_text(tmp_path: Path, llm_server: LLMServer) -> None:
    # Class 6, with `skilltrain daemon --once` itself: at debug litellm logs
    # whole requests and replies; the reply quotes the key.
    llm_server.default = lambda request: Reply.ok(
        "Notes.\n\n" + "\n\n".join(adversarial.LONG_COMMON))
    ws = key_workspace(tmp_path, llm_server)
    config = ws.config_path.read_text(encoding="utf-8").replace('level = "info"',
                                                                'level = "debug"')
    ws.config_path.write_text(config, encoding="utf-8")

    result, _ = run_cli("daemon", "--once", "--config", str(ws.config_path), timeout=120)

    assert result.returncode == 0, result.stderr[-2000:]
    assert len(ws.events("loss.completed")) == 2
    withheld = ws.events("library.withheld")
    assert withheld and all(set(e) >= {"logger", "chars", "sha256"} for e in withheld)
    assert max(e["chars"] for e in withheld) > 4000  # a whole request, not written
    assert not human_runs(result.stderr)
    assert_sealed(ws)


def test_audit_cli_follows_symlinks_into_data(tmp_path: Path, llm_server: LLMServer) -> None:
    # Class 7, the audit's side: a link under runs/ to a human episode.
    ws = key_workspace(tmp_path, llm_server)
    audit = ("audit", "--config", str(ws.config_path))
    clean, _ = run_cli(*audit)
    assert clean.returncode == 0, clean.stdout + clean.stderr

    notes = ws.runs / "r1" / "notes"
    notes.mkdir()
    (notes / "ep02.txt").symlink_to(ws.data / "beauty0" / "human" / "ep02.txt")
    linked, _ = run_cli(*audit, "--json")
    assert linked.returncode == 1
    doc = json.loads(linked.stdout)
    assert [Path(x["file"]).name for x in doc["links_into_data"]] == ["ep02.txt"]
    assert doc["clean"] is False

    # A link to a copy outside data/ is read through: its content is the key.
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ws.data / "beauty0" / "human", elsewhere)
    (notes / "ep02.txt").unlink()
    (notes / "copy").symlink_to(elsewhere, target_is_directory=True)
    copied, _ = run_cli(*audit)
    assert copied.returncode == 1
    assert "notes/copy/ep05.txt" in copied.stdout


def test_state_reasons_are_checked_against_every_work(tmp_path: Path) -> None:
    # Whatever text reaches the state store (an exception's, a library's) is
    # checked like a log line once the daemon has the answer keys.
    other = leakguard.HumanIndex.build("brick", {1: (adversarial.CORPUS /
                                                     "brick_and_steel.txt").read_text("utf-8")})
    leakguard.install(leakguard.AnswerKeys([other, leakguard.HumanIndex.build("k", KEY)]))
    quote = adversarial.DISGUISES["pipe-joined"](adversarial.LONG_COMMON[0])
    store = StateStore(tmp_path / "runs")
    store.update("r1/e0/s0/k/01-03", SetState.FAILED, reason=f"KeyError: {quote} (HTTP 400)")
    store.flush(force=True, pid=None)
    store.close()
    saved = store.path.read_bytes().decode("utf-8", "replace")
    assert "KeyError: [verbatim answer-key passage removed]. (HTTP 400)" in saved
    assert not human_runs(saved)


def test_a_run_folder_named_with_a_line_of_the_key_is_not_scored(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # A run's name goes into every report path, state row and log line of it:
    # a writer that names its run with a line of the key is refused, once.
    line = adversarial.LONG_COMMON[0]
    ws = key_workspace(tmp_path, llm_server)
    ws.write_step(line, 0, 0, success=True)

    run_once_in_process(ws)

    assert not (ws.runs / line / "loss").exists()  # nothing written into it
    assert ws.has_report(ws.sets_of_step("r1", 0, 0)[0])  # the other run is scored
    (refused,) = ws.events("set.unusable")
    assert "quotes the answer key" in refused["reason"]
    assert not [e for e in ws.events("loss.queued") if e["run"] != "r1"]
    saved = ws.state_file.read_bytes().decode("utf-8", "replace")
    assert "quotes the answer key" in saved and not human_runs(saved)
    assert_sealed(ws)


NEW_LINE = "Quillon pawned the brass sextant to settle Ezekiel's ferry debt before the tide turned."


def test_a_key_edited_while_the_daemon_runs_is_guarded_in_the_log_without_a_restart(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # Issue 25: the log's indexes were built at start. A line added to the key
    # later, then used as a run folder's name (in every log line of that run),
    # must be known to the log's guard and to the run-name check at once.
    ws = key_workspace(tmp_path, llm_server)
    episode = ws.data / "beauty0" / "human" / "ep03.txt"
    with DaemonProcess(ws) as daemon:
        daemon.wait_event("step.reported", 60, run="r1")
        with episode.open("a", encoding="utf-8") as f:  # edited in place: same inode
            f.write(f"\nLESTER\n{NEW_LINE}\n")
        reloaded = daemon.wait_event("answer_keys.reloaded", 20)
        assert reloaded["works"] == 1 and reloaded["episodes"] == 6
        # A work added while it runs is guarded too.
        added = ws.data / "added" / "human"
        added.mkdir(parents=True)
        (added / "ep01.txt").write_text(
            "INT. VAULT - NIGHT\n\nODO\nThe tallow clerk sold every ledger of the marsh "
            "parish to the Flemish glassblowers.\n", encoding="utf-8")
        daemon.wait_event("answer_keys.reloaded", 20, works=2)
        ws.write_step(NEW_LINE, 0, 0, success=True)
        refused = daemon.wait_event("set.unusable", 30)
        assert "quotes the answer key" in refused["reason"]
        ws.write_step("The tallow clerk sold every ledger of the marsh parish", 0, 0,
                      success=True)
        wait_until(lambda: len(ws.events("set.unusable")) == 2, 30,
                   message="the run named with the added work's line refused")
    log = ws.log_file.read_text(encoding="utf-8")
    assert "[verbatim answer-key passage removed]" in log
    assert "sextant" not in log and "tallow" not in log
    assert not [e for e in ws.events("loss.queued") if e["run"] != "r1"]


# ------------------------------------------------------------ other works' keys


def other_work_workspace(tmp_path: Path, server: LLMServer) -> Workspace:
    """Two works: "beauty" (the corpus screenplay as its key) and "other"; a
    finished step whose run scores only "other"."""
    ws = build_workspace(tmp_path / "ws", server.url, works={"beauty": 6, "other": 6},
                         max_attempts=1)
    for ep, text in KEY.items():
        (ws.data / "beauty" / "human" / f"ep{ep:02d}.txt").write_text(text, encoding="utf-8")
    ws.write_step("r1", 0, 0, works=["other"], success=True)
    (ws.runs / "r1" / "run.toml").write_text('works = ["other"]\n', encoding="utf-8")
    return ws


@pytest.mark.parametrize("how", ["hard link", "copy"])
def test_another_works_key_in_the_scripts_is_refused_unsent(
        tmp_path: Path, llm_server: LLMServer, how: str) -> None:
    # The copy check knew only the set's own work: another work's episode,
    # hard-linked or copied into scripts/, was sent, archived whole and quotable.
    ws = other_work_workspace(tmp_path, llm_server)
    script = ws.scripts("r1", 0, 0, "other") / "ep02.txt"
    script.unlink()
    key_episode = ws.data / "beauty" / "human" / "ep02.txt"
    if how == "hard link":
        os.link(key_episode, script)
    else:
        shutil.copy(key_episode, script)

    run_once_in_process(ws)

    (refused,) = ws.events("loss.refused", range="01-03")
    assert "100% the text of human ep02.txt of work beauty" in refused["reason"]
    assert not [r for r in llm_server.requests if human_runs(prompt_of(r))]
    assert_sealed(ws)


@pytest.mark.parametrize("how", ["second file of a number", "one byte changed",
                                 "own key, one byte changed"])
def test_a_key_episode_changed_or_filed_twice_in_the_scripts_is_refused_unsent(
        tmp_path: Path, llm_server: LLMServer, how: str) -> None:
    # An exact hash found a copy; a byte changed, or a second file of an episode
    # number (its digest was of the two joined), went out to the LLM and into
    # the archive, whose model text is allowed (a review of this change).
    ws = other_work_workspace(tmp_path, llm_server)
    script = ws.scripts("r1", 0, 0, "other") / "ep02.txt"
    if how == "second file of a number":
        only_here = "\n".join(reversed(KEY[5].splitlines())) + "\n"
        (ws.data / "beauty" / "human" / "ep002.txt").write_text(only_here, encoding="utf-8")
        script.write_text(only_here, encoding="utf-8")
    else:
        work = "other" if how.startswith("own") else "beauty"
        text = (ws.data / work / "human" / "ep02.txt").read_text(encoding="utf-8")
        script.write_text(text[:-2] + ("x" if text[-2] != "x" else "y") + text[-1:],
                          encoding="utf-8")

    run_once_in_process(ws)

    (refused,) = ws.events("loss.refused", range="01-03")
    assert "the text of human ep02.txt of work" in refused["reason"]
    assert "(a copy of its answer key); not sent" in refused["reason"]
    assert not [r for r in llm_server.requests if human_runs(prompt_of(r))]
    assert not list(ws.runs.rglob("other_ep01-03*"))
    assert_sealed(ws)


def test_a_report_quoting_the_second_file_of_an_episode_is_redacted(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # The job's own index took the range's episodes as read (ep01.txt) over
    # the two files joined: a quote of ep001.txt in the report on ep01-03 went out.
    quote = ("Marguerite winds the clockwork lens while the gulls wheel through the copper "
             "beam")
    llm_server.default = lambda request: Reply.ok(
        f"The original trusts images.\n\nAs the original has it: {quote}.\n")
    ws = key_workspace(tmp_path, llm_server)
    (ws.data / "beauty0" / "human" / "ep001.txt").write_text(
        f"INT. LIGHTHOUSE GALLERY - NIGHT\n\n{quote} above the drowned orchard.\n",
        encoding="utf-8")

    run_once_in_process(ws)

    assert len(list(ws.runs.rglob("beauty0_ep0?-0?.md"))) == 2
    assert not [p for p in ws.runs.rglob("*") if p.is_file()
                and "clockwork lens" in p.read_text(encoding="utf-8", errors="replace")]


def test_a_report_quoting_another_works_key_is_redacted(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # The guard read a report against its own work's key only: a model quoting
    # a screenplay it memorised, which the operator also trains on, got that
    # key into the report, its sidecar's claims and the archive's neighbours.
    line = "Lester thrusts his face directly into a steaming hot shower."
    assert human_runs(line)
    llm_server.default = lambda request: Reply.ok(
        f"The original trusts images.\n\nAs another film has it: {line}\n")
    ws = other_work_workspace(tmp_path, llm_server)

    run_once_in_process(ws)

    reports = sorted(ws.runs.rglob("other_ep0?-0?.md"))
    assert len(reports) == 2
    for report in reports:
        assert "[verbatim answer-key passage removed]" in report.read_text(encoding="utf-8")
    assert_sealed(ws)


@pytest.mark.parametrize(("words_a_line", "streams", "bar"), [
    (3, 1, False), (5, 1, False), (4, 2, False), (4, 1, True)])
def test_a_passage_a_program_prints_wrapped_over_lines_is_cut(words_a_line: int,
                                                                 streams: int,
                                                                 bar: bool) -> None:
    # The writer's and optimizer's output is logged a line at a time, and the
    # log's guard read each line alone: a passage printed a few words a line
    # went out whole, each line under the guard's length.
    import sys

    from skilltrain.handlers import optimizer

    line = "Lester thrusts his face directly into a steaming hot shower."
    assert human_runs(line)
    words = line.split()
    wrapped = "\n".join(" ".join(words[i:i + words_a_line])
                        for i in range(0, len(words), words_a_line))
    emitted: list[str] = []
    leakguard.install(leakguard.AnswerKeys([leakguard.index_for(adversarial.WORK, KEY)]))
    try:
        # streams=2: its lines alternate between stdout and stderr, each flushed.
        program = ("import sys, time\n"
                   f"for k, line in enumerate({wrapped!r}.split(chr(10))):\n"
                   f"    out = (sys.stdout, sys.stderr)[k % {streams}]\n"
                   "    print(line, file=out, flush=True); time.sleep(0.05)\n"
                   # bar: a progress bar on stderr between two lines of stdout,
                   # more than the window holds
                   + ("    [print(chr(13) + '#' * 80, end='', file=sys.stderr, flush=True)"
                      " for _ in range(10)]\n" if bar else ""))
        result = optimizer.run([sys.executable, "-c", program], timeout_s=30,
                               emit=lambda event, **f: emitted.append(f["line"]))
    finally:
        leakguard.install(None)
    assert result.exit_code == 0
    assert len(emitted) >= wrapped.count("\n") + 1
    assert not human_runs(" ".join(e for e in emitted if "#" not in e)), emitted
    assert "[verbatim answer-key passage removed]" in " ".join(emitted)


def test_a_short_episode_is_read_whole_for_the_copy_check() -> None:
    # Every 8th run is read for a long episode; a 14-word stub that opens with
    # the key's title and heading had one sampled run, the key's: "100 % a copy".
    from skilltrain.daemon.core import dataset
    from skilltrain.daemon.guard import job_keys

    example = Path(__file__).resolve().parent.parent / "data" / "example"
    index = leakguard.index_for("example", dataset.load_work(example).read_all_human())
    opening = (example / "human" / "ep01.txt").read_text(encoding="utf-8").split("\n\n")[:2]
    stub = "\n\n".join(opening[:1] + ["EXT. CARROW WATER - DAM - DAY", "Marta looks at it."])
    job_keys.refuse_near_copies(Path("scripts"), {1: stub}, (index,))  # not a copy
    copy = (example / "human" / "ep01.txt").read_text(encoding="utf-8").replace("dam", "dan", 1)
    with pytest.raises(RefusedError, match=r"is 9\d% the text of human ep01.txt of work example"):
        job_keys.refuse_near_copies(Path("scripts"), {1: copy}, (index,))
