"""Benchmark the answer-key leak guard against the naive alternatives.

    .venv/bin/python bench/leakguard_bench.py [--corpus-only]

Prints: index build time for data/example (if present) and for a synthetic
200,000-word work; check time of a 10,000-word report (median, p99) against
rebuilding the index per check and against a substring scan of every human
line; recall and false-positive rates for shingle lengths 5-9 with and
without the content-word rule (rule 2 alone); the issue 11 table on the
adversarial corpus (tests/corpus): recall per disguise and false positives on
independent screenplays, non-quoting reports and stock lines, for rule 2
alone, rule 1 with any words, and the chosen rules; audit throughput on a
50 MB JSON log; peak memory. Seeded, so runs are comparable; about 30 s on 2
cores.
"""

from __future__ import annotations

import json
import random
import re
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skilltrain.daemon.core import textnorm
from skilltrain.daemon.guard import audit, leakguard, leakguard_index
from skilltrain.daemon.guard.leakguard import HumanIndex, find_leaks

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.corpus import adversarial  # noqa: E402 - needs ROOT on the path

SEED = 20240601

# Lines every screenplay may contain: a guard that flags these when the human
# script has them too is a false positive.
STOCK = [
    "I don't know.",
    "What are you doing here?",
    "I don't know what you're talking about.",
    "I don't want to talk about it.",
    "What the hell are you doing here?",
    "We need to talk.",
    "Are you okay?",
    "I'll be right back.",
    "Get out of here!",
    "I'm sorry, I didn't mean to.",
    "You don't have to do this.",
    "Is there something you want to tell me?",
    "I think we should go now.",
    "What do you want from me?",
    "I can't do this anymore.",
    "Let me know if you need anything.",
    "I have no idea what that means.",
    "I was just about to call you.",
    "I don't think that's a good idea.",
    "You have no idea what I've been through.",
    "We have to get out of here, now.",
    "Can I talk to you for a second?",
    "There's something I need to tell you.",
    "I told you I didn't want to see you again.",
    "It's not what you think.",
    "I'm not going anywhere.",
    "What are you talking about?",
    "Do you have any idea what time it is?",
    "Is everything all right?",
    "I'll take care of it.",
    "Thank you so much for coming.",
    "I want you to listen to me very carefully.",
    "Don't worry about it, it's fine.",
    "It's been a long time.",
    "I know what I saw.",
    "Why didn't you tell me?",
    "I'm so sorry for your loss.",
    "Let's get out of here.",
    "You should go home and get some sleep.",
    "Where have you been all this time?",
]

# Distinctive lines a writer would want to keep out of the skill.
DISTINCT = [
    "You left the gate open again, and the goats are halfway to Hollis.",
    "The money in the biscuit tin was never yours to spend.",
    "Your father sold this tractor to my father for a handshake and a pie.",
    "Some lies hold a house together better than nails.",
    "I buried the ledger under the plum tree the night Mother died.",
    "Every bridge in this county has my grandfather's name on a rivet.",
    "Tell the bishop his choir sings flat and his wine is worse.",
    "You smell like diesel and bad decisions.",
    "The lighthouse keeper's logbook lies about the shipwreck.",
    "Nobody drowns in Lake Marrow unless the lake wants them to.",
    "Sell the piano, keep the dog, burn the letters.",
    "My sister married a dentist to spite a dentist.",
    "Fourteen winters I fed that furnace and it never once thanked me.",
    "If the mayor wants a parade, he can march alone.",
    "The ferry stopped running the summer the mill burned down.",
    "Paint the fence green and pretend it was always green.",
    "He counted the spoons after every funeral supper.",
    "A lawyer, a priest and a goat walked into my kitchen.",
    "The telegram arrived three weeks after the wedding.",
    "Grandmother hid the deed inside the family Bible.",
    "Bring the lantern, the rope and the good whiskey.",
    "We traded the orchard for a tractor that never started.",
    "Her ghost still complains about the wallpaper.",
    "Forty acres of rye and not one honest neighbour.",
    "The circus left town but the elephant stayed behind.",
    "Don't trust a banker who wears his hat indoors.",
    "Marrow Creek floods every spring and every spring we act surprised.",
    "The last train to Dunmore leaves without its conductor.",
    "I pawned the wedding ring to pay for the wedding.",
    "Keep the shotgun loaded and the kettle warm.",
]

# A made-up report's prose around the quotes.
PROSE = (
    "The model compresses the argument into a single beat where the original lets it "
    "breathe across three scenes, and its action lines explain motives the human script "
    "leaves for the actor to play. Dialogue in the model is on the nose; the human version "
    "uses subtext and interruption. Scene transitions in the model are abrupt."
).split()


def _lexicon(rng: random.Random, size: int) -> list[str]:
    letters = "abcdefghijklmnoprstuvwy"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(size)]


def synthetic_work(words: int, episodes: int, seed: int) -> dict[int, str]:
    """A screenplay-shaped text: headings, cues, parentheticals, action, dialogue.

    Word frequencies are Zipf-like, mixing real English function words with an
    invented lexicon so that the content-word rule has work to do.
    """
    rng = random.Random(seed)
    function = sorted(leakguard_index._FILLER)
    lexicon = _lexicon(rng, 6000)
    vocab = function + lexicon
    weights = [1.0 / (rank + 1) ** 0.9 for rank in range(len(vocab))]
    rng.shuffle(weights)  # function and lexicon words both get frequent ones
    names = [w.upper() for w in _lexicon(rng, 8)]
    places = [w.upper() for w in _lexicon(rng, 30)]
    per_episode = words // episodes
    out: dict[int, str] = {}
    for ep in range(1, episodes + 1):
        lines: list[str] = []
        count = 0
        while count < per_episode:
            if rng.random() < 0.05:
                lines += [
                    "",
                    f"{rng.choice(['INT.', 'EXT.'])} {rng.choice(places)} - "
                    f"{rng.choice(['DAY', 'NIGHT', 'CONTINUOUS'])}",
                    "",
                ]
            k = rng.randint(3, 18)
            text = " ".join(rng.choices(vocab, weights, k=k)).capitalize() + "."
            if rng.random() < 0.3:
                lines += [text, ""]  # action
            else:
                lines += [rng.choice(names)]
                if rng.random() < 0.1:
                    lines.append("(beat)")
                lines += [text, ""]
            count += k
        out[ep] = "\n".join(lines)
    return out


def _dialogue_lines(episodes: dict[int, str]) -> list[str]:
    return [
        line
        for text in episodes.values()
        for line in text.splitlines()
        if line.endswith(".") and not line.isupper()
    ]


def make_report(human: dict[int, str], words: int, quotes: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = [line for line in _dialogue_lines(human) if len(line.split()) >= 9]
    body: list[str] = []
    planted = 0
    while len(body) < words:
        body += rng.sample(PROSE, 25)
        if planted < quotes and len(body) > (planted + 1) * words // (quotes + 1):
            body.append(f'"{rng.choice(lines)}"')
            planted += 1
    return " ".join(body[:words])


def timed(fn: Callable[[], Any], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def p99(times: list[float]) -> float:
    return sorted(times)[min(len(times) - 1, int(len(times) * 0.99))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def naive_substring(report: str, human_lines: list[str]) -> int:
    """The obvious alternative: is any normalised human line inside the report?"""
    norm = " ".join(leakguard.tokens(report))
    return sum(1 for line in human_lines if line in norm)


def _read_episodes(folder: Path) -> dict[int, str]:
    files = sorted(folder.glob("ep*.txt")) if folder.is_dir() else []
    return {int(re.sub(r"\D", "", p.stem)): p.read_text(encoding="utf-8") for p in files}


def bench_example() -> tuple[dict[int, str], dict[int, str]]:
    """data/example/human (the answer key) and model_draft (a closed-book draft), if present."""
    human = _read_episodes(ROOT / "data" / "example" / "human")
    draft = _read_episodes(ROOT / "data" / "example" / "model_draft")
    if not human:
        print("data/example/human: not present, skipped")
        return {}, {}
    best = min(timed(lambda: HumanIndex.build("example", human), 5))
    index = HumanIndex.build("example", human)
    print(
        f"data/example: {len(human)} episodes, {index.n_words:,} words, build {ms(best)}, "
        f"{len(index.episode_of):,} shingles, {len(index.seeds):,} distinctive"
    )
    if draft:
        draft_toks = leakguard.tokens("\n".join(draft.values()))
        print(
            f"  shingles an independent draft ({len(draft)} episodes, {len(draft_toks):,} "
            "words) shares with the human script:"
        )
        for n in range(4, 10):
            ix = HumanIndex.build("example", human, n=n, long_n=99)
            mine = set(leakguard.shingle_hashes(draft_toks, n))
            print(
                f"    n={n}: {len(mine & ix.episode_of.keys()):4d} shared, "
                f"{len(mine & ix.seeds):3d} of them distinctive"
            )
    return human, draft


def bench_synthetic() -> tuple[dict[int, str], HumanIndex]:
    human = synthetic_work(200_000, 10, SEED)
    tracemalloc.start()
    index = HumanIndex.build("synthetic", human)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    build = timed(lambda: HumanIndex.build("synthetic", human), 3)
    print(
        f"synthetic work: {index.n_words:,} words in {len(human)} episodes; build median "
        f"{ms(statistics.median(build))} (min {ms(min(build))}); "
        f"{len(index.episode_of):,} shingles, {len(index.seeds):,} distinctive; "
        f"build peak {peak / 2**20:.1f} MiB (tracemalloc)"
    )
    return human, index


def bench_check(human: dict[int, str], index: HumanIndex) -> None:
    report = make_report(human, 10_000, quotes=5, seed=SEED + 1)
    clean = make_report(human, 10_000, quotes=0, seed=SEED + 1)
    model = synthetic_work(30_000, 3, SEED + 2)
    allow = "\n".join(model.values())
    leaks = find_leaks(report, index)
    print(
        f"report: {len(report.split()):,} words, 5 planted quotes -> {len(leaks)} leaks "
        f"({sum(k.n_words for k in leaks)} words)"
    )
    checks = timed(lambda: find_leaks(report, index), 200)
    clean_checks = timed(lambda: find_leaks(clean, index), 200)
    with_allow = timed(lambda: find_leaks(report, index, allow_text=allow), 30)
    rebuild = timed(lambda: find_leaks(report, HumanIndex.build("synthetic", human)), 3)
    lines = [" ".join(leakguard.tokens(line)) for line in _dialogue_lines(human)]
    lines = [line for line in lines if len(line.split()) >= leakguard.SHINGLE_WORDS]
    substring = timed(lambda: naive_substring(report, lines), 3)
    med = statistics.median(checks)
    print(
        f"check, 5 leaks: median {ms(med)}, p99 {ms(p99(checks))} (200 runs); no leak: median "
        f"{ms(statistics.median(clean_checks))}, p99 {ms(p99(clean_checks))}"
    )
    print(
        "  with a 30,000-word allow_text (tokenised per call): median "
        f"{ms(statistics.median(with_allow))}"
    )
    print(
        f"  vs rebuilding the index per check: median {ms(statistics.median(rebuild))} "
        f"= {statistics.median(rebuild) / med:.0f}x slower"
    )
    print(
        f"  vs substring scan of {len(lines):,} human lines (finds whole lines only): median "
        f"{ms(statistics.median(substring))} = {statistics.median(substring) / med:.0f}x slower"
    )


def bench_rates(example: dict[int, str], draft: dict[int, str]) -> None:
    """Recall of distinctive lines, false positives on stock lines and on an independent draft."""
    rng = random.Random(SEED + 3)
    names = ["MARTHA", "WALTER", "ADA", "TOMAS"]
    human_lines = STOCK + DISTINCT
    rng.shuffle(human_lines)
    human = "\n\n".join(f"{rng.choice(names)}\n{line}" for line in human_lines)
    print(
        "rates (rule 2 alone): each line quoted once in a report sentence; 'draft' = spans "
        "flagged in data/example/model_draft"
    )
    print(
        f"   n  content>=  stock flagged (of {len(STOCK)})  distinctive found (of "
        f"{len(DISTINCT)})  draft spans"
    )
    for n in range(5, 10):
        for min_content in (0, leakguard.MIN_CONTENT_WORDS):
            index = HumanIndex.build("rates", {1: human}, n=n, min_content=min_content,
                                     long_n=99)
            fp = sum(bool(find_leaks(f"She says '{s}' here.", index)) for s in STOCK)
            tp = sum(bool(find_leaks(f"She says '{s}' here.", index)) for s in DISTINCT)
            drafted = "-"
            if example and draft:
                ix = HumanIndex.build("example", example, n=n, min_content=min_content,
                                      long_n=99)
                drafted = str(sum(len(find_leaks(text, ix)) for text in draft.values()))
            chosen = (n, min_content) == (leakguard.SHINGLE_WORDS, leakguard.MIN_CONTENT_WORDS)
            print(
                f"  {n:2d}  {min_content:9d}  {fp:18d}  {tp:23d}  {drafted:>11}"
                + ("  <- chosen" if chosen else "")
            )
    lengths = [len(leakguard.tokens(s)) for s in STOCK]
    print(
        f"  stock lines are {min(lengths)}-{max(lengths)} words; "
        f"{sum(k >= 7 for k in lengths)} of {len(STOCK)} have 7 or more"
    )


# Rule variants compared on the corpus: (label, HumanIndex.build keywords).
VARIANTS = [
    ("rule 2 alone (7 words, 2 content)", {"long_n": 99}),
    ("+ rule 1, 8 words with 1 not stock", {"long_min_content": 1}),
    ("+ rule 1, any 8 words of the lines (issue 11)", {"long_reach": "lines"}),
    ("+ any one line whole, headings too (chosen, issue 25)", {}),
    ("+ any 8 words, across headings and cues", {"long_reach": "any"}),
]
# Stock lines of 8+ words beyond leakguard.STOCK_LINES, all filler or not.
STOCK_LONG = [
    "What the hell do you think you're doing?",
    "I don't know what you're talking about, man.",
    "We need to talk about what happened last night.",
    "Do you have any idea what time it is?",
    "Let me know if you need anything else.",
    "I thought I told you to stay in the car.",
    "I'm not going to let anything happen to you.",
    "You should go home and get some sleep.",
    "I want you to listen to me very carefully.",
    "I told you I didn't want to see you again.",
]


def _caught(index: HumanIndex, quote: str, disguise: Callable[[str], str]) -> bool:
    """The redaction covers the disguised quote but for less than 8 of its words at either end.

    Judged on characters, not by reading the result: a disguise the guard
    cannot read would hide from a check that reads like the guard.
    """
    shown = disguise(quote)
    report = adversarial.report_quoting(shown)
    start = report.index(shown)
    end = start + len(shown)
    covered = [(max(k.start, start), min(k.end, end)) for k in find_leaks(report, index)
               if k.start < end and k.end > start]
    if not covered:
        return False
    words = quote.split()
    head = len(disguise(" ".join(words[:8])))  # about 8 words of the disguised text
    tail = len(disguise(" ".join(words[-8:])))
    return (min(s for s, _ in covered) - start < head and end - max(e for _, e in covered) < tail
            and all(b[0] - a[1] < head for a, b in zip(covered, covered[1:], strict=False)))


def _screenplay_with(lines: list[str], base: str, cue: str) -> str:
    """`base` with `lines` added as dialogue of `cue`, between its scenes."""
    blocks = base.split("\n\n")
    step = max(1, len(blocks) // (len(lines) + 1))
    for k, line in enumerate(lines):
        blocks.insert((k + 1) * step + k, f"{cue}\n{line}")
    return "\n\n".join(blocks)


def bench_corpus(example: dict[int, str], draft: dict[int, str]) -> None:
    """Issue 11: recall per disguise and false positives on text nobody here wrote."""
    key = adversarial.key()
    quotes = adversarial.quotable_lines(key) + [adversarial.CROSS_RANGE]
    brick = (adversarial.CORPUS / "brick_and_steel.txt").read_text(encoding="utf-8")
    reports = (adversarial.CORPUS / "reports.md").read_text(encoding="utf-8")
    key_text = "\n\n".join(key.values())
    print(f"corpus: key {sum(len(textnorm.tokens(t)) for t in key.values()):,} words in "
          f"{len(key)} episodes, {len(quotes)} lines of 8+ words quoted in "
          f"{len(adversarial.DISGUISES)} disguises")
    for label, kwargs in VARIANTS:
        index = HumanIndex.build("key", key, **kwargs)  # type: ignore[arg-type]
        per = {name: sum(_caught(index, q, f) for q in quotes)
               for name, f in adversarial.DISGUISES.items()}
        total = sum(per.values())
        worst = min(per, key=per.__getitem__)
        fp = {
            "Brick & Steel": len(find_leaks(brick, index)),
            "reports": len(find_leaks(reports, index)),
            "example human": len(find_leaks("\n".join(example.values()), index)),
            "example draft": len(find_leaks("\n".join(draft.values()), index)),
        }
        ex = HumanIndex.build("example", example, **kwargs)  # type: ignore[arg-type]
        fp["draft vs example"] = sum(len(find_leaks(t, ex)) for t in draft.values())
        fp["key vs example"] = len(find_leaks(key_text, ex))
        # Stock lines in both the key and an independent script (Brick & Steel):
        # those listed in leakguard.STOCK_LINES, and held-out ones.
        for name, lines in (("listed stock", list(leakguard.STOCK_LINES)),
                            ("held-out stock", STOCK_LONG)):
            stock_key = HumanIndex.build("stock", {
                n: _screenplay_with(lines if n == 3 else [], t, "LESTER") for n, t in key.items()
            }, **kwargs)  # type: ignore[arg-type]
            other = _screenplay_with(lines, brick, "STEEL")
            fp[f"{name} (of {len(lines)})"] = len(find_leaks(other, stock_key))
        # Issue 25: every heading of 8+ words of either key, quoted whole in a report.
        heads = [(line.strip(), ix) for work, ix in ((key, index), (example, ex))
                 for text in work.values() for line in text.splitlines()
                 if line.strip().startswith(("INT", "EXT"))
                 and len(textnorm.tokens(line)) >= leakguard.LONG_RUN_WORDS]
        fp[f"long headings caught (of {len(heads)})"] = sum(
            bool(find_leaks(f"The original opens on {h} and stays there.", ix)) for h, ix in heads)
        print(f"  {label}: recall {total}/{len(quotes) * len(adversarial.DISGUISES)} "
              f"({100 * total / (len(quotes) * len(adversarial.DISGUISES)):.1f}%), worst "
              f"disguise {worst} {per[worst]}/{len(quotes)}; false-positive spans: "
              + ", ".join(f"{k} {v}" for k, v in fp.items()))
    missed = [q for q in quotes if not _caught(HumanIndex.build("key", key), q, str)]
    print(f"  chosen rules miss {len(missed)} line(s), every word stock: {missed}")
    bench_spelled(key, quotes, {"Brick & Steel": brick, "reports": reports,
                                "example human": "\n".join(example.values()),
                                "example draft": "\n".join(draft.values())}, example, draft)


def bench_spelled(key: dict[int, str], quotes: list[str], controls: dict[str, str],
                  example: dict[int, str], draft: dict[int, str]) -> None:
    """The key spelled out (leakguard_spelled): recall per disguise, and false
    positives on independent text spelled out the same way, line by line."""
    index = HumanIndex.build("key", key)
    ex = HumanIndex.build("example", example)
    for name, spell in adversarial.SPELLED_DISGUISES.items():
        found = sum(_caught(index, q, spell) for q in quotes)
        fp = {label: len(find_leaks(_spelled_lines(text, spell), index))
              for label, text in controls.items()}
        fp["draft vs example"] = len(find_leaks(_spelled_lines("\n".join(draft.values()), spell),
                                                ex))
        print(f"  spelled out, {name}: recall {found}/{len(quotes)}; false-positive spans: "
              + ", ".join(f"{k} {v}" for k, v in fp.items()))


def _spelled_lines(text: str, spell: Callable[[str], str]) -> str:
    return "\n".join(spell(line) for line in text.splitlines() if len(line.split()) >= 3)


def _write_log(path: Path, mib: int, rng: random.Random) -> int:
    """A structured JSON log like the daemon's: keys, ids, numbers, short messages."""
    works = ["example", "low-water", "hollis"]
    size = 0
    with path.open("w", encoding="utf-8") as f:
        i = 0
        while size < mib * 2**20:
            event = {
                "event": rng.choice(["loss.completed", "loss.started", "scan.completed"]),
                "timestamp": f"2026-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}.{i % 997:03d}Z",
                "run": f"run-{i % 7}",
                "work": rng.choice(works),
                "range": f"{i % 9 + 1:02d}-{i % 9 + 3:02d}",
                "tokens_in": rng.randint(1000, 90000),
                "cost_usd": round(rng.random(), 4),
                "msg": " ".join(rng.sample(PROSE, 8)) + ".\n\u2014 ok",
            }
            line = json.dumps(event) + "\n"
            f.write(line)
            size += len(line)
            i += 1
    return size


def bench_audit(human: dict[int, str], index: HumanIndex) -> None:
    rng = random.Random(SEED + 4)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        size = _write_log(root / "daemon.log.jsonl", 50, rng)
        start, cpu = time.perf_counter(), time.process_time()
        result = audit.scan(root, [index])
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(
            f"audit: {size / 2**20:.0f} MiB structured JSON log (escapes on every line) in "
            f"{elapsed:.2f} s ({cpu:.2f} s CPU) = {size / 2**20 / elapsed:.0f} MiB/s, "
            f"{len(result.hits)} hits"
        )
        (root / "daemon.log.jsonl").unlink()
        # Worst case: prose made only of the human script's own words, so every
        # window must be hashed (a pile of unredacted reports would be like this).
        words = leakguard.tokens("\n".join(human.values()))
        prose = " ".join(rng.choices(words, k=1_500_000))
        (root / "reports.md").write_text(prose, encoding="utf-8")
        start, cpu = time.perf_counter(), time.process_time()
        result = audit.scan(root, [index])
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        mib = len(prose) / 2**20
        print(
            f"audit worst case: {mib:.0f} MiB of prose in the human script's own words in "
            f"{elapsed:.2f} s ({cpu:.2f} s CPU) = {mib / elapsed:.1f} MiB/s, "
            f"{len(result.hits)} hits"
        )


def main() -> int:
    start = time.perf_counter()
    print(
        f"leakguard bench: n={leakguard.SHINGLE_WORDS}, "
        f"content words>={leakguard.MIN_CONTENT_WORDS}, long runs {leakguard.LONG_RUN_WORDS} "
        f"words with >={leakguard.LONG_MIN_CONTENT_WORDS} not stock, "
        f"python {sys.version.split()[0]}"
    )
    example, draft = bench_example()
    if "--corpus-only" not in sys.argv:
        human, index = bench_synthetic()
        bench_check(human, index)
        bench_rates(example, draft)
    bench_corpus(example, draft)
    if "--corpus-only" in sys.argv:
        return 0
    bench_audit(human, index)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        f"peak RSS {rss / 1024:.0f} MiB; total {time.perf_counter() - start:.1f} s "
        f"({time.process_time():.1f} s CPU)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
