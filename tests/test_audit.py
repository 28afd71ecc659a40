"""audit: every file under runs/ is scanned for answer-key passages."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from skilltrain.daemon.guard import audit, leakguard
from skilltrain.daemon.guard.audit import Hit

HUMAN_EP3 = """\
INT. LIGHTHOUSE - LAMP ROOM - NIGHT

The lens turns. ADA (70s) polishes brass that does not need it.

ADA
Your grandfather kept this light burning through the storm of fifty-two.

TOMAS
And he kept the logbook lying about the shipwreck, didn’t he?

ADA
(quietly)
Some lies hold a house together better than nails.
"""
WORKS = {"lighthouse": {3: HUMAN_EP3}}
LINE = "Your grandfather kept this light burning through the storm of fifty-two."
CURLY = "And he kept the logbook lying about the shipwreck, didn’t he?"

# The model's script of the same scene: shares names, headings and stock words.
MODEL_EP3 = """\
INT. LIGHTHOUSE - LAMP ROOM - NIGHT

ADA
I don't know what you're talking about. The light has always burned.

TOMAS
(beat)
Grandfather lied in the logbook. I read it.
"""


def audit_tree(root: Path, indexes: list[leakguard.HumanIndex]) -> list[Hit]:
    return audit.scan(root, indexes).hits


@pytest.fixture()
def index() -> leakguard.HumanIndex:
    return leakguard.HumanIndex.build("lighthouse", WORKS["lighthouse"])


def _clean_tree(root: Path) -> Path:
    step = root / "run1" / "epoch_00" / "step_00" / "lighthouse" / "scripts"
    step.mkdir(parents=True)
    (step / "ep03.txt").write_text(MODEL_EP3, encoding="utf-8")
    loss = root / "run1" / "loss" / "epoch_00" / "step_00"
    loss.mkdir(parents=True)
    (loss / "lighthouse_ep03-03.md").write_text(
        "# Loss\n\nThe model's Ada explains where the original implies. "
        "INT. LIGHTHOUSE - LAMP ROOM - NIGHT opens both. ADA and TOMAS argue; "
        "\"I don't know what you're talking about\" is stock.\n",
        encoding="utf-8",
    )
    (loss / "lighthouse_ep03-03.json").write_text(
        json.dumps({"work": "lighthouse", "range": "03-03", "leaks_redacted": 1}),
        encoding="utf-8",
    )
    (root / "daemon.log.jsonl").write_text(
        "\n".join(json.dumps({"event": "loss.completed", "i": i}) for i in range(50)) + "\n",
        encoding="utf-8",
    )
    return root


def test_clean_tree_passes(
    tmp_path: Path, index: leakguard.HumanIndex, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _clean_tree(tmp_path / "runs")
    assert audit_tree(root, [index]) == []
    assert audit.run(root, WORKS, as_json=False) == 0
    out = capsys.readouterr().out
    assert "no answer-key passages" in out and "4 files" in out


def test_leak_in_jsonl_and_nested_file(
    tmp_path: Path, index: leakguard.HumanIndex, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _clean_tree(tmp_path / "runs")
    # JSON escapes: \n between cue and line, \u2019 for the curly apostrophe
    # (json.dumps' default ensure_ascii), \" around the quote.
    event = {"event": "loss.failed", "prompt_tail": f'TOMAS\n"{CURLY}"\nADA'}
    log = root / "daemon.log.jsonl"
    lines = log.read_text(encoding="utf-8").splitlines()
    lines.insert(7, json.dumps(event))
    log.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert "\\u2019" in lines[7] and "\\n" in lines[7]
    deep = root / "run1" / "optimizer" / "epoch_00" / "step_00" / "notes"
    deep.mkdir(parents=True)
    (deep / "skill.md").write_text(f"# Skill\n\n- keep it short\n- write lines like:\n  {LINE}\n")

    hits = audit_tree(root, [index])
    assert [(h.file.relative_to(root).as_posix(), h.line, h.work, h.episode) for h in hits] == [
        ("daemon.log.jsonl", 8, "lighthouse", 3),
        ("run1/optimizer/epoch_00/step_00/notes/skill.md", 5, "lighthouse", 3),
    ]
    # The cue names around the quoted line in the log are the human's too.
    assert hits[0].n_words == 13 and hits[1].n_words == 12
    for hit in hits:
        assert len(hit.excerpt.replace(" …", "").split()) <= audit.EXCERPT_WORDS
    assert hits[0].excerpt == 'TOMAS "And he kept the logbook lying about …'

    assert audit.run(root, WORKS, as_json=False) == 1
    out = capsys.readouterr().out
    assert "daemon.log.jsonl:8: lighthouse ep03, 13 words" in out
    assert "skill.md:5:" in out
    assert "2 answer-key passage(s) in 2 file(s)" in out


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _clean_tree(tmp_path / "runs")
    (root / "state.json").write_text(json.dumps({"last_report": f"x {LINE} y"}), "utf-8")
    assert audit.run(root, WORKS, as_json=True) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["clean"] is False
    assert doc["files_scanned"] == 5
    assert doc["errors"] == []
    (hit,) = doc["hits"]
    assert Path(hit["file"]).name == "state.json"
    assert {k: hit[k] for k in ("line", "work", "episode", "n_words")} == {
        "line": 1,
        "work": "lighthouse",
        "episode": 3,
        "n_words": 12,
    }


def test_symlinks_are_followed_and_links_into_data_reported(
    tmp_path: Path, index: leakguard.HumanIndex, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    (data / "lighthouse" / "human").mkdir(parents=True)
    human = data / "lighthouse" / "human" / "ep03.txt"
    human.write_text(HUMAN_EP3, encoding="utf-8")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "copy.txt").write_text(HUMAN_EP3, encoding="utf-8")
    root = _clean_tree(tmp_path / "runs")
    (root / "dangling").symlink_to(tmp_path / "nowhere")
    (root / "loop").symlink_to(root, target_is_directory=True)  # walked once
    assert audit.run(root, WORKS, as_json=False, data_root=data) == 0
    capsys.readouterr()

    (root / "link_to_human.txt").symlink_to(human)
    (root / "link_to_data").symlink_to(data, target_is_directory=True)
    (root / "link_elsewhere").symlink_to(elsewhere, target_is_directory=True)
    result = audit.scan(root, [index], data_root=data)
    assert sorted(link.file.name for link in result.links) == ["link_to_data", "link_to_human.txt"]
    # A link to a file outside data/ is read as that file, reported under the link.
    (hit,) = result.hits
    assert hit.file == root / "link_elsewhere" / "copy.txt"
    assert hit.n_words == index.n_words
    assert audit.run(root, WORKS, as_json=False, data_root=data) == 1
    out = capsys.readouterr().out
    assert "link_to_human.txt: symlink into the answer key's folder" in out
    assert "2 symlink(s) into data/" in out
    # Without a data folder to compare with, the link's content is still scanned.
    (root / "link_elsewhere").unlink()
    assert {h.file.name for h in audit_tree(root, [index])} == {"link_to_human.txt", "ep03.txt"}


def test_fifo_is_skipped(tmp_path: Path, index: leakguard.HumanIndex) -> None:
    root = _clean_tree(tmp_path / "runs")
    os.mkfifo(root / "pipe")  # reading it would block the audit forever
    assert audit_tree(root, [index]) == []


def test_binary_and_gzip_files(tmp_path: Path, index: leakguard.HumanIndex) -> None:
    root = _clean_tree(tmp_path / "runs")
    blob = b"\x00\xff\xfe" * 100 + b"\n" + LINE.encode() + b"\n\x80\x81"
    (root / "archive.bin").write_bytes(blob)
    with gzip.open(root / "daemon.log.1.gz", "wt", encoding="utf-8") as f:
        f.write("x\n" * 9 + json.dumps({"msg": LINE}) + "\n")
    found = {(h.file.name, h.line) for h in audit_tree(root, [index])}
    assert found == {("archive.bin", 2), ("daemon.log.1.gz", 10)}


def test_passage_across_chunk_boundary(tmp_path: Path, index: leakguard.HumanIndex) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    filler = ("ok\n" * (audit.CHUNK_CHARS // 3))[: audit.CHUNK_CHARS - 40]
    head = filler[: filler.rfind("\n") + 1]
    text = head + LINE + "\nmore\n"
    assert len(head) < audit.CHUNK_CHARS < len(head) + len(LINE)
    (root / "big.log").write_text(text, encoding="utf-8")
    (hit,) = audit_tree(root, [index])
    assert hit.line == head.count("\n") + 1
    assert hit.n_words == 12


def test_large_log_is_fast_enough(tmp_path: Path, index: leakguard.HumanIndex) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    line = json.dumps({"event": "loss.completed", "work": "lighthouse", "msg": "tokens in out"})
    (root / "big.jsonl").write_text((line + "\n") * 80_000 + json.dumps({"m": LINE}) + "\n")
    result = audit.scan(root, [index])
    assert result.chars > 5_000_000
    assert [h.line for h in result.hits] == [80_001]


def test_every_encoding_is_found_with_its_line(tmp_path: Path,
                                               index: leakguard.HumanIndex) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    disguised = [
        LINE.upper(),
        "|".join(LINE.split()),
        "\u200b".join(LINE.split()),
        LINE.replace("e", "\u0435").replace("o", "\u043e"),  # Cyrillic look-alikes
        LINE.replace(" ", "&nbsp;").replace("'", "&#x27;"),
        json.dumps(json.dumps(LINE)),  # JSON inside JSON
        "".join(f"%{b:02X}" for b in LINE.encode()),
        "\u00ad".join(LINE),  # a soft hyphen between every letter
    ]
    (root / "mixed.log").write_text("head\n" + "\nok\n".join(disguised) + "\n", "utf-8")
    hits = audit_tree(root, [index])
    assert [h.line for h in hits] == [2 + 2 * i for i in range(len(disguised))]


def test_no_works_or_no_runs_is_not_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _clean_tree(tmp_path / "runs")
    assert audit.run(root, {}, as_json=False) == 1
    assert audit.run(tmp_path / "missing", WORKS, as_json=False) == 1
    err = capsys.readouterr().err
    assert "no human episodes" in err and "not a directory" in err


def test_format_hits() -> None:
    hit = Hit(Path("/r/a/b.md"), 4, "w", 2, 9, "one two")
    assert audit.format_hits([hit], Path("/r")) == 'a/b.md:4: w ep02, 9 words: "one two"'
    assert hit.to_json()["file"] == "/r/a/b.md"


def test_damaged_gzip_is_reported_not_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _clean_tree(tmp_path / "runs")
    good = gzip.compress(("x\n" * 1000).encode())
    (root / "daemon.log.2.gz").write_bytes(good[: len(good) // 2])  # truncated
    (root / "daemon.log.3.gz").write_bytes(b"\x1f\x8b" + b"\x00" * 64)  # not gzip
    result = audit.scan(root, [])
    assert [e.split(":")[0].rsplit("/", 1)[-1] for e in result.errors] == [
        "daemon.log.2.gz",
        "daemon.log.3.gz",
    ]
    assert audit.run(root, WORKS, as_json=False) == 1
    assert "unreadable" in capsys.readouterr().err


def test_a_long_heading_of_the_key_is_found_whole(tmp_path: Path) -> None:
    # Issue 25: headings were exempt; nine words of rare names are the key.
    heading = "EXT. QUIXWELL-ARBANOV LIGHTHOUSE - ZELTRANE SLIPWAY - VORSK DUNES - DAWN"
    index = leakguard.HumanIndex.build("lighthouse", {3: f"{heading}\n\n{HUMAN_EP3}"})
    root = _clean_tree(tmp_path / "runs")
    assert audit_tree(root, [index]) == []  # the short shared heading stays allowed
    notes = root / "run1" / "optimizer" / "notes.md"
    notes.parent.mkdir(parents=True)
    notes.write_text(f"# Skill\n\nOpen like the original: {heading}\n", encoding="utf-8")
    (hit,) = audit_tree(root, [index])
    assert (hit.file, hit.line, hit.n_words) == (notes, 3, 9)


# ------------------------------------------- issue 34: the audit agrees with the guard


def _set_tree(root: Path, model: dict[int, str], report: str) -> tuple[Path, Path]:
    """A scored set as the loss step leaves it: episodes, report, archive, sidecar."""
    scripts = root / "r1" / "epoch_00" / "step_00" / "beauty" / "scripts"
    scripts.mkdir(parents=True)
    for n, text in model.items():
        (scripts / f"ep{n:02d}.txt").write_text(text, encoding="utf-8")
    loss = root / "r1" / "loss" / "epoch_00" / "step_00"
    loss.mkdir(parents=True)
    block = "\n\n".join(f"### Model ep{n:02d}\n\n{t}" for n, t in model.items())
    (loss / "beauty_ep01-03_prompt.md").write_text(
        f"Compare.\n\n[human screenplay omitted]\n\n{block}\n", encoding="utf-8")
    (loss / "beauty_ep01-03.md").write_text(report, encoding="utf-8")
    (loss / "beauty_ep01-03.json").write_text(json.dumps({"claims": {}}), encoding="utf-8")
    return scripts, loss


def test_the_models_own_lines_are_allowed_where_the_guard_allows_them(tmp_path: Path) -> None:
    # A writer of the same story writes some of the key's lines itself (an LLM
    # does: "Is it true she got a glass eye"). The guard lets its report quote
    # them and its archive holds them; the audit flagged each (128 hits on a
    # clean run in the issue). A planted quote is still found everywhere else.
    from tests.corpus import adversarial

    key = adversarial.key()
    index = leakguard.index_for("beauty", key)
    own = adversarial.LONG_COMMON[:3]  # lines of the key the model wrote too
    model = {n: f"INT. HOUSE - DAY\n\nLESTER\n{own[n - 1]}\n\nCAROLYN\nFine.\n"
             for n in (1, 2, 3)}
    report = f"The model keeps the line '{own[0]}' and loses the image.\n"
    scripts, loss = _set_tree(tmp_path, model, report)
    copies = audit.human_copies({"beauty": key})

    assert audit.scan(tmp_path, [index], copies=copies).hits == []

    planted = adversarial.LONG_COMMON[4]  # not in the model's episodes
    (loss / "beauty_ep01-03.md").write_text(report + f"\nAs the original says: {planted}\n",
                                            encoding="utf-8")
    (tmp_path / "r1" / "skill.md").write_text(f"Write like: {own[1]}\n", encoding="utf-8")
    (tmp_path / "skilltrain.jsonl").write_text(json.dumps({"event": own[2]}) + "\n",
                                               encoding="utf-8")
    (scripts / "ep04.txt").write_text(key[2], encoding="utf-8")  # a copy of the key
    hits = audit.scan(tmp_path, [index], copies=copies).hits
    assert sorted(str(h.file.relative_to(tmp_path)) for h in hits) == [
        "r1/epoch_00/step_00/beauty/scripts/ep04.txt",
        "r1/loss/epoch_00/step_00/beauty_ep01-03.md",
        "r1/skill.md",  # the model's text is allowed in its set's files, not anywhere
        "skilltrain.jsonl",
    ]


def test_a_copy_of_the_key_among_the_episodes_allows_nothing(tmp_path: Path) -> None:
    # The loss step never sends a copy of a human episode (nor a link to one):
    # it does not make the key the model's own text in the set's report.
    from tests.corpus import adversarial

    key = adversarial.key()
    index = leakguard.index_for("beauty", key)
    model = {1: key[1], 2: "INT. HOUSE - DAY\n\nLESTER\nFine.\n", 3: "EXT. STREET\n"}
    quote = adversarial.LONG_COMMON[0]
    assert quote in key[1]
    scripts, loss = _set_tree(tmp_path, model, f"It says: {quote}\n")
    hits = audit.scan(tmp_path, [index], copies=audit.human_copies({"beauty": key})).hits
    files = {str(h.file.relative_to(tmp_path)) for h in hits}
    assert "r1/loss/epoch_00/step_00/beauty_ep01-03.md" in files
    assert "r1/epoch_00/step_00/beauty/scripts/ep01.txt" in files


def test_the_start_audit_reads_again_what_older_reading_rules_found_clean(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from skilltrain.daemon.core import dataset, textnorm
    from skilltrain.daemon.service import start_audit

    data, runs = tmp_path / "data", tmp_path / "runs"
    (data / "farm" / "human").mkdir(parents=True)
    (data / "farm" / "human" / "ep01.txt").write_text(
        "MARTHA\nThe money in the biscuit tin was never yours to spend.\n", encoding="utf-8")
    (runs / "r1").mkdir(parents=True)
    (runs / "r1" / "notes.md").write_text("Nothing of the key.\n", encoding="utf-8")
    works = dataset.discover_works(data)

    def audit() -> dict[str, object]:
        events: list[dict[str, object]] = []
        start_audit.audit_runs(runs, works, data, lambda event, **f: events.append(f))
        return events[-1]

    assert audit()["skipped"] == 0
    assert audit()["skipped"] == 1  # unchanged, clean against the same keys
    monkeypatch.setattr(textnorm, "VERSION", textnorm.VERSION + 1)
    assert audit()["skipped"] == 0  # clean under the old rules says nothing now
