"""`skilltrain audit` on clean runs and on planted quotes (issue 34).

    .venv/bin/python bench/audit_hits.py [--steps 20]

Builds a workspace in a temporary folder and counts the audit's hits:

1. the shipped example (data/example, its model draft, the built-in reviewer);
2. a closed loop of --steps steps (the toy writer and optimizer of examples/);
3. a real screenplay as the key: *Brick & Steel* (tests/corpus), whose
   "model" episodes keep a third of the key's lines as they are (a writer of
   the same story writes some of its lines: the issue's 128 false hits) and
   word their other lines their own way;

then plants key lines in eight places (a report, disguised with backticks;
a sidecar string; a prompt archive outside the model's block; the JSON log,
JSON-escaped; the optimizer's skill.md; a stray note; the state folder; a
copy of a human episode among the model's) and counts what is found. Run
with the checkout's code, or another's through PYTHONPATH (the audit is run
as `python -m skilltrain audit --json`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BRICK = ROOT / "tests" / "corpus" / "brick_and_steel.txt"


def skilltrain(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    result = subprocess.run([sys.executable, "-m", "skilltrain", *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=600)
    if check and result.returncode not in (0, 1):
        raise SystemExit(f"skilltrain {args[0]}: {result.returncode}\n{result.stderr[-2000:]}")
    return result


def audit(ws: Path) -> list[dict[str, object]]:
    result = skilltrain("audit", "--config", "config.toml", "--json", cwd=ws)
    hits: list[dict[str, object]] = json.loads(result.stdout)["hits"]
    return hits


def split_brick() -> dict[int, str]:
    """Brick & Steel in three episodes, cut at scene headings."""
    text = BRICK.read_text(encoding="utf-8")
    scenes = re.split(r"\n(?=(?:EXT|INT)\. )", text)
    third = -(-len(scenes) // 3)
    return {n + 1: "\n".join(scenes[n * third:(n + 1) * third]).strip() + "\n"
            for n in range(3)}


def model_of(human: str) -> str:
    """The same scenes: headings and cues kept, a third of the lines as the key
    has them, the others in the model's words."""
    out = []
    k = 0
    for line in human.splitlines():
        s = line.strip()
        words = s.split()
        if not s or s.isupper() or s.startswith("(") or len(words) < 4:
            out.append(line)
            continue
        k += 1
        out.append(line if k % 3 == 0 else
                   f"{words[0]} does it the model's way this time, beat {k}, not the key's.")
    return "\n".join(out) + "\n"


def config(ws: Path, loop_steps: int) -> None:
    (ws / "config.toml").write_text(f"""
[paths]
data = "data"
runs = "runs"
prompts = "prompts"

[llm]
model = "builtin/craft-metrics"

[loss]
settle_s = 1

[writer]
command = ["{sys.executable}", "{ROOT}/examples/toy_writer.py", "{{run_dir}}", "{{epoch}}",
           "{{step}}", "--work", "example:6", "--steps-per-epoch", "{loop_steps}",
           "--prev-reports", "{{prev_reports_dir}}"]
timeout_s = 60

[optimizer]
command = ["{sys.executable}", "{ROOT}/examples/toy_optimizer.py", "{{run_dir}}",
           "{{reports_dir}}", "{{epoch}}", "{{step}}"]
timeout_s = 60

[loop]
steps_per_epoch = {loop_steps}
max_epochs = 1

[log]
file = "runs/skilltrain.jsonl"

[integrity]
audit_on_start = false
""", encoding="utf-8")


def workspace(root: Path, loop_steps: int) -> Path:
    ws = root / "ws"
    (ws / "data").mkdir(parents=True)
    shutil.copytree(ROOT / "data" / "example", ws / "data" / "example")
    shutil.copytree(ROOT / "prompts", ws / "prompts")
    brick = split_brick()
    (ws / "data" / "brick" / "human").mkdir(parents=True)
    (ws / "data" / "brick" / "work.toml").write_text('title = "Brick & Steel"\n'
                                                      "ranges = [[1, 3]]\n", encoding="utf-8")
    for n, text in brick.items():
        (ws / "data" / "brick" / "human" / f"ep{n:02d}.txt").write_text(text, encoding="utf-8")
    config(ws, max(1, loop_steps))
    step = ws / "runs" / "clean" / "epoch_00" / "step_00"
    (step / "example" / "scripts").mkdir(parents=True)
    for p in sorted((ROOT / "data" / "example" / "model_draft").glob("ep*.txt")):
        shutil.copy(p, step / "example" / "scripts")
    (step / "brick" / "scripts").mkdir(parents=True)
    for n, text in brick.items():
        (step / "brick" / "scripts" / f"ep{n:02d}.txt").write_text(model_of(text),
                                                                  encoding="utf-8")
    for work in ("example", "brick"):
        (step / work / "scripts" / "_SUCCESS").touch()
    return ws


def run_loop(ws: Path) -> None:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    daemon = subprocess.Popen([sys.executable, "-m", "skilltrain", "daemon", "--config",
                               "config.toml"], cwd=ws, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        (ws / "runs" / "loop").mkdir()
        (ws / "runs" / "loop" / "run.toml").write_text('works = ["example"]\n')
        skilltrain("start", "loop", "--config", "config.toml", cwd=ws)
        log = ws / "runs" / "skilltrain.jsonl"
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if log.exists() and '"run.finished"' in log.read_text(encoding="utf-8"):
                return
            time.sleep(0.5)
        raise SystemExit("the loop did not finish in 15 minutes")
    finally:
        daemon.terminate()
        daemon.wait(30)


def plant(ws: Path) -> dict[str, str]:
    """A key line in eight places; returns file -> what was planted."""
    human = (ws / "data" / "brick" / "human" / "ep01.txt").read_text(encoding="utf-8")
    line = "A gorgeous day. The sun is shining. But BRICK BRADDOCK, retired police detective"
    assert line in human
    ticked = re.sub(r"\b(\w\w)(\w\w+)", r"\1`\2", line)
    loss = ws / "runs" / "clean" / "loss" / "epoch_00" / "step_00"
    planted = {}

    def add(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(text)
        planted[str(path.relative_to(ws / "runs"))] = text

    add(loss / "brick_ep01-03.md", f"\nAs the original has it: {ticked}\n")
    sidecar = json.loads((loss / "brick_ep01-03.json").read_text(encoding="utf-8"))
    sidecar["note"] = line
    (loss / "brick_ep01-03.json").write_text(json.dumps(sidecar), encoding="utf-8")
    planted[str((loss / "brick_ep01-03.json").relative_to(ws / "runs"))] = "note"
    add(loss / "brick_ep01-03_prompt.md", f"\n{line}\n")
    add(ws / "runs" / "skilltrain.jsonl", json.dumps({"event": "x", "reason": line}) + "\n")
    add(ws / "runs" / "loop" / "skill.md", f"\nWrite like this: {line}\n")
    add(ws / "runs" / "notes" / "scratch.txt", line.upper() + "\n")
    add(ws / "runs" / ".skilltrain" / "debug.txt", line + "\n")
    copy = ws / "runs" / "clean" / "epoch_00" / "step_00" / "brick" / "scripts" / "ep09.txt"
    shutil.copy(ws / "data" / "brick" / "human" / "ep02.txt", copy)
    planted[str(copy.relative_to(ws / "runs"))] = "copy"
    return planted


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ws = workspace(Path(tmp), args.steps)
        skilltrain("daemon", "--once", "--config", "config.toml", cwd=ws)
        reports = sorted(p.name for p in (ws / "runs" / "clean" / "loss").rglob("*.md"))
        print(f"clean run: {len(reports)} reports and archives")
        by_work: dict[str, int] = {}
        for hit in audit(ws):
            by_work[str(hit["work"])] = by_work.get(str(hit["work"]), 0) + 1
        print(f"  hits on the example: {by_work.get('example', 0)}; "
              f"on Brick & Steel: {by_work.get('brick', 0)}")
        if args.steps:
            run_loop(ws)
            steps = len(list((ws / "runs" / "loop" / "loss").glob("epoch_*/step_*")))
            hits = [h for h in audit(ws) if "/loop/" in str(h["file"])]
            print(f"loop: {steps} steps reported; hits under runs/loop: {len(hits)}")
        planted = plant(ws)
        found = {str(Path(str(h["file"])).relative_to(ws / "runs")) for h in audit(ws)}
        print(f"planted in {len(planted)} files; found in {len(found & planted.keys())}; "
              f"hits in other files: {sorted(found - planted.keys())}")
        for name in sorted(planted.keys() - found):
            print(f"  missed: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
