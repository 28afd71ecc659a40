"""Issue 34: the guard has the last word on every byte written under runs/.

A report hides lines of the key behind markup inside words (grab`bed,
gr*abbed): in its prose and in its `## Claims` list, whose parser used to
strip the markup after the guard and save the rejoined line in the sidecar.
What lands under runs/ is read here with a normalisation written for this
test alone (`read_as_a_person`), not the guard's textnorm: it shares no code
with what it checks.
"""

from __future__ import annotations

import html
import json
import random
import re
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from skilltrain.daemon.core.errors import RefusedError
from skilltrain.daemon.guard import leakguard, sealed_write
from tests.corpus import adversarial
from tests.daemon_helpers import (
    DaemonProcess,
    Workspace,
    build_workspace,
    human_screenplays,
    release_llm_clients,
    run_cli,
    run_once_in_process,
    write_human_episodes,
)
from tests.llm_server import LLMServer, Reply

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

# ------------------------------------------------ an independent reading


_INVISIBLE = re.compile(r"[`*_~\\\\\u00ad\u200b-\u200f\u2060\ufeff]|-\n")
_TAGS = re.compile(r"<!--.*?-->|</?[A-Za-z][^<>]*>", re.S)


def read_as_a_person(text: str) -> list[str]:
    """Words as a reader sees them: entities and JSON escapes decoded, marks,
    invisible characters and markup inside words dropped, case and accents gone."""
    for _ in range(3):
        text = html.unescape(text)
        text = re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), text)
        text = text.replace('\\"', '"').replace("\\n", "\n")
    text = re.sub(r"\u00ad\s*\n\s*", "", text)
    text = _INVISIBLE.sub("", _TAGS.sub("", text))
    text = "".join(c for c in unicodedata.normalize("NFKD", text)
                   if not unicodedata.combining(c))
    text = text.lower().replace("\u2019", "'").replace("'", "")
    return re.findall(r"[a-z0-9]+", text)


def _key_runs() -> set[tuple[str, ...]]:
    runs = set()
    for line in adversarial.quotable_lines(KEY):
        words = read_as_a_person(line)
        runs.update(tuple(words[i:i + RUN]) for i in range(len(words) - RUN + 1))
    return runs


KEY_RUNS = _key_runs()


def key_runs_in(text: str) -> list[str]:
    words = read_as_a_person(text)
    return [" ".join(words[i:i + RUN]) for i in range(len(words) - RUN + 1)
            if tuple(words[i:i + RUN]) in KEY_RUNS]


def assert_nothing_of_the_key_under(runs: Path) -> None:
    for path in runs.rglob("*"):
        if path.is_file() and "scripts" not in path.parts:
            found = key_runs_in(path.read_text(encoding="utf-8", errors="replace"))
            assert not found, f"{path.relative_to(runs)}: {found[:2]}"


# ------------------------------------------------------- the disguised reply


def _inside(mark: str, line: str) -> str:
    return re.sub(r"\b(\w\w)(\w\w+)", lambda m: m.group(1) + mark + m.group(2), line)


LONG = sorted((ln for ln in adversarial.quotable_lines(KEY) if len(ln.split()) >= 12),
              key=len)
BODY_QUOTE, CLAIM_QUOTE, STAR_QUOTE = LONG[0], LONG[1], LONG[2]


def disguised_report() -> str:
    return (
        "The original trusts images.\n\n"
        f"Compare: {_inside('`', BODY_QUOTE)} -- the model explains instead.\n\n"
        "## Claims\n\n"
        "- speech_words_mean: higher\n"
        f"- {_inside('`', CLAIM_QUOTE).rstrip('.')}: higher\n"
        f"- {_inside('*', STAR_QUOTE).rstrip('.')}: lower\n"
    )


def key_workspace(tmp_path: Path, server: LLMServer, on_leak: str) -> Workspace:
    ws = build_workspace(tmp_path / "ws", server.url, works={"beauty": 6}, max_attempts=1,
                         extra=f'\n[integrity]\non_leak = "{on_leak}"\n')
    for ep, text in KEY.items():
        (ws.data / "beauty" / "human" / f"ep{ep:02d}.txt").write_text(text, encoding="utf-8")
    ws.write_step("r1", 0, 0, success=True)
    return ws


def test_the_disguised_reply_holds_the_key_as_a_person_reads_it() -> None:
    # The test's own reading sees the three quotes (else the tests below prove nothing).
    assert len(key_runs_in(disguised_report())) >= 3 * (12 - RUN + 1)


@pytest.mark.parametrize("on_leak", ["redact", "refuse"])
def test_a_claim_hiding_a_quote_behind_markup_never_reaches_runs_through_the_daemon(
        tmp_path: Path, llm_server: LLMServer, on_leak: str) -> None:
    llm_server.default = lambda request: Reply.ok(disguised_report())
    ws = key_workspace(tmp_path, llm_server, on_leak)

    run_once_in_process(ws)

    sets = ws.sets_of_step("r1", 0, 0)
    if on_leak == "redact":
        for s in sets:
            assert ws.has_report(s)
            report = ws.report(s).read_text(encoding="utf-8")
            assert report.count(leakguard.REDACTION_MARKER) == 3
            assert "the model explains instead" in report
            claims = ws.read_sidecar(s)["claims"]
            assert [v["statistic"] for v in claims["verdicts"]] == ["speech_words_mean"]
            assert [m["line"] for m in claims["malformed_lines"]] == [8, 9]
    else:
        assert not any(ws.report(s).exists() or ws.sidecar(s).exists() for s in sets)
        assert len(ws.events("loss.refused")) == len(sets)
    assert_nothing_of_the_key_under(ws.runs)


@pytest.mark.parametrize("on_leak", ["redact", "refuse"])
def test_a_claim_hiding_a_quote_behind_markup_never_reaches_runs_through_skilltrain_loss(
        tmp_path: Path, llm_server: LLMServer, on_leak: str) -> None:
    llm_server.default = lambda request: Reply.ok(disguised_report())
    ws = key_workspace(tmp_path, llm_server, on_leak)
    out = ws.runs / "r1" / "loss" / "epoch_00" / "step_00" / "beauty_ep01-03.md"

    result, _ = run_cli("loss", "--config", str(ws.config_path), "--work",
                        str(ws.data / "beauty"), "--first", "1", "--last", "3",
                        "--scripts", str(ws.scripts("r1", 0, 0, "beauty")),
                        "--out", str(out), timeout=120)

    if on_leak == "redact":
        assert result.returncode == 0, result.stderr[-2000:]
        assert "3 leaks redacted" in result.stdout
        sidecar = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
        assert [v["statistic"] for v in sidecar["claims"]["verdicts"]] == ["speech_words_mean"]
    else:
        assert result.returncode == 1
        assert "refused" in result.stderr and not out.exists()
    assert not key_runs_in(result.stdout + result.stderr)
    assert_nothing_of_the_key_under(ws.runs)


# ------------------------------------------------------- the write boundary


def test_the_writer_refuses_key_text_that_appears_after_the_guard(tmp_path: Path) -> None:
    # Whatever produced it (a parser, a serialiser), the final text is read.
    index = leakguard.index_for("beauty", KEY)
    seal = sealed_write.Seal(index, allow_text="")
    line = adversarial.LONG_COMMON[1]
    sidecar = json.dumps({"claims": {"verdicts": [{"statistic": _inside("`", line)}]}})
    files = {tmp_path / "a.md": "A clean report.\n", tmp_path / "a.json": sidecar}
    with pytest.raises(sealed_write.SealRefused, match="a.json") as refused:
        sealed_write.write_all(files, seal)
    assert isinstance(refused.value, RefusedError)
    assert list(tmp_path.iterdir()) == []  # all or none
    sealed_write.write_all({tmp_path / "a.md": "A clean report.\n"}, seal)
    assert (tmp_path / "a.md").read_text(encoding="utf-8") == "A clean report.\n"


def test_other_files_under_runs_are_held_against_every_installed_key(tmp_path: Path) -> None:
    leakguard.install(leakguard.AnswerKeys([leakguard.index_for("beauty", KEY)]))
    try:
        line = adversarial.LONG_COMMON[0]
        with pytest.raises(sealed_write.SealRefused):
            sealed_write.write_text(tmp_path / "marker.json",
                                    json.dumps({"reason": _inside("*", line)}))
        assert not (tmp_path / "marker.json").exists()
        sealed_write.write_text(tmp_path / "marker.json", '{"reported": true}\n')
        assert (tmp_path / "marker.json").is_file()
    finally:
        leakguard.install(None)


# --------------------------------------------------------- the property test

Disguise = Callable[[str, random.Random], str]


def _mark_inside(marks: str) -> Disguise:
    def disguise(line: str, rng: random.Random) -> str:
        def one(m: re.Match[str]) -> str:
            word = m.group()
            if len(word) < 3 or rng.random() < 0.3:
                return word
            cut = rng.randrange(1, len(word))
            return word[:cut] + rng.choice(marks) + word[cut:]
        return re.sub(r"\w+", one, line)
    return disguise


DISGUISES: dict[str, Disguise] = {
    "backtick": _mark_inside("`"),
    "star": _mark_inside("*"),
    "bold": _mark_inside(["**"]),  # type: ignore[list-item]
    "underscore": _mark_inside("_"),
    "tilde": _mark_inside("~"),
    "mixed markup": _mark_inside("`*_~"),
    "soft hyphen": _mark_inside("\u00ad"),
    "zero-width": _mark_inside("\u200b\u200d\u2060"),
    "combining mark": _mark_inside("\u0301\u0308"),
    "HTML entity": _mark_inside(["&#96;", "&shy;", "&#x200B;"]),  # type: ignore[list-item]
    "soft hyphen at a line break": _mark_inside(["\u00ad\n"]),  # type: ignore[list-item]
    "backtick apostrophe": lambda line, rng: line.replace("'", "`"),
    "HTML tags": _mark_inside(["<b></b>", "<i>", "<!-- x -->"]),  # type: ignore[list-item]
    "Markdown escape": _mark_inside(["\\_", "\\*"]),  # type: ignore[list-item]
}


def _random_key_line(rng: random.Random) -> str:
    """A random stretch of 8 to 16 words of one line of the key."""
    line = rng.choice([ln for ln in adversarial.quotable_lines(KEY) if len(ln.split()) >= 8])
    words = line.split()
    n = rng.randint(8, min(16, len(words)))
    start = rng.randint(0, len(words) - n)
    return " ".join(words[start:start + n])


def test_no_eight_word_run_of_the_key_is_written_whatever_the_disguise(
        tmp_path: Path) -> None:
    # The loss step's last stage, seeded: a random stretch of a key line in a
    # random disguise (one, or two stacked), in a report's prose, its claims
    # and a sidecar; whatever is written holds no 8-word run of the key.
    from skilltrain.daemon.reviewer import craft_claims

    index = leakguard.index_for("beauty", KEY)
    seal = sealed_write.Seal(index)
    rng = random.Random(34)
    written = refused = 0
    for n in range(300):
        names = rng.sample(sorted(DISGUISES), rng.choice([1, 2]))
        quote = _random_key_line(rng)
        for name in names:
            quote = DISGUISES[name](quote, rng)
        report = (f"Prose.\n\nThe original: {quote} -- and the model.\n\n"
                  f"## Claims\n\n- {quote}: higher\n- dialogue_share: lower\n")
        # As the loss step does: redact, read the claims, serialise, write.
        leaks = leakguard.find_leaks(report, index)
        report = leakguard.redact(report, leaks)
        claims = craft_claims.read_claims(report)
        sidecar = json.dumps({"claims": [c.statistic for c in claims.claims]}, indent=2)
        folder = tmp_path / f"{n:03d}"
        try:
            sealed_write.write_all({folder / "r.md": report, folder / "r.json": sidecar}, seal)
            written += 1
        except sealed_write.SealRefused:
            refused += 1
        for path in folder.glob("*") if folder.is_dir() else ():
            found = key_runs_in(path.read_text(encoding="utf-8"))
            assert not found, (names, quote, found)
    assert written > 250  # the guard redacted what it saw, the seal had little left


# ------------------------------------------------- a work added while it runs


def test_a_work_added_to_data_while_the_daemon_runs_is_scored_without_a_restart(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # Its key was guarded at once (issue 25); its runs were "unknown work"
    # until a restart.
    ws = build_workspace(tmp_path / "ws", llm_server.url, works={"alpha": 3})
    ws.write_step("r1", 0, 0, success=True)
    with DaemonProcess(ws) as daemon:
        daemon.wait_event("step.reported", 60, run="r1")
        write_human_episodes(ws.root, "beta", human_screenplays("beta", 3))
        ws.works["beta"] = 3
        ws.write_step("r1", 0, 1, works=["beta"], success=True)
        done = daemon.wait_event("loss.completed", 60, work="beta")
    assert done["range"] == "01-03" and done["step"] == 1
    assert not ws.events("set.ignored")
    assert [e["added"] for e in ws.events("works.reloaded")] == [["beta"]]


def test_what_is_appended_after_the_guard_is_read_with_the_words_before_it(
        tmp_path: Path) -> None:
    # The seal remembers the report its guard found clean; text appended to
    # it (an annotation) is read again, with the seam: a quote that starts
    # in the report and ends in the annotation is a quote.
    index = leakguard.index_for("beauty", KEY)
    seal = sealed_write.Seal(index)
    words = adversarial.LONG_COMMON[1].split()
    report = "The original trusts images. " + " ".join(words[:7])  # 7 words: no leak alone
    assert seal.find(report) == []
    sealed_write.write_all({tmp_path / "ok.md": report + "\n"}, seal)
    with pytest.raises(sealed_write.SealRefused):
        sealed_write.write_all({tmp_path / "r.md": f"{report} {' '.join(words[7:])}\n"}, seal)
    assert not (tmp_path / "r.md").exists()


def test_an_archive_piece_read_before_is_read_again_at_its_seams(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The template's text before the model's episodes is the same for every
    # step: once found clean it is not read again, but a quote that starts at
    # its end and runs on into the text beside it is still a quote.
    index = leakguard.index_for("beauty", KEY)
    words = adversarial.LONG_COMMON[1].split()
    slot = "[model-scripts-0]"
    head = "Compare the two screenplays and write the report.\n\n" * 40
    block = "DEV\nWe go at dawn, before the tide.\n" * 30

    def archive(end_of_head: str, block_start: str = "") -> sealed_write.Archive:
        skeleton = f"{head}{end_of_head}\n{slot}\n=== End ===\n"
        text = block_start + block
        return sealed_write.Archive(skeleton.replace(slot, text), skeleton, slot, text)

    read: list[int] = []
    real_find = leakguard.find_leaks
    monkeypatch.setattr(leakguard, "find_leaks",
                        lambda text, *a, **k: read.append(len(text)) or real_find(text, *a, **k))
    clean = archive(" ".join(words[:4]))  # four words of the line: no leak alone
    whole = []
    for _ in range(3):  # seen, then read alone, then known
        read.clear()
        assert not sealed_write.Seal(index).archive_leaks(clean)
        whole.append(sum(n >= len(head) for n in read))
    assert whole == [1, 1, 0], whole  # the second time: alone, then its edges only
    assert max(read, default=0) < len(head) // 2, read  # known: only its edges were read
    # The same piece before a block that opens with the rest of the line.
    seam = archive(" ".join(words[:4]), block_start=" ".join(words[4:]) + "\n")
    assert sealed_write.Seal(index).archive_leaks(seam)
    # And at the far seam: the block ends with the line's start, the piece
    # after it (known clean too) goes on with the rest.
    rest = " ".join(words[7:])  # seven words: no leak alone
    skeleton = f"{head}\n{slot} {rest}\n=== End ===\n"
    for _ in range(3):
        assert not sealed_write.Seal(index).archive_leaks(
            sealed_write.Archive(skeleton.replace(slot, block), skeleton, slot, block))
    ending = block + " ".join(words[:7])
    assert sealed_write.Seal(index).archive_leaks(
        sealed_write.Archive(skeleton.replace(slot, ending), skeleton, slot, ending))
