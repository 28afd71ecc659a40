"""`skilltrain status` as text: the daemon, one line per run, what needs attention.

  runs: daemon running (pid 4242) since 2026-12-10 09:12 (3h12m ago), catching up:
      120 queued, 8 running; state written 2s ago           (one line, cut here)
  run  phase    at       sets         failed  refused  stuck  spend             last report
  r00  scoring  e09/s19  1,998/2,000       1        0      1  $12.3400 of $50   5s ago
  needs attention (3):
    failed    r00/epoch_01/step_02/w03/01-05  gave up after 5 attempts: LLMError: ...

With a run name, that run's steps follow its line; with --all, every step
of every run and every row that needs attention. Plain aligned columns: a
table library took most of a second to lay out a few hundred rows.
"""
from __future__ import annotations

import time
from typing import Any, TextIO

from .status_attention import KINDS

_STATES = ("done", "queued", "running", "settling", "waiting", "stale", "held", "failed",
           "refused")
_REASON_CHARS = 200


def render(data: dict[str, Any], out: TextIO, *, run: str | None = None,
           show_all: bool = False) -> None:
    now = data["generated_at"]
    lines = [daemon_line(data, now)]
    if instance := data.get("instance"):  # which training on this host, and which state
        lines.append(f"{instance['describe']}; state {instance['state']}")
    if data["daemon"].get("state_unreadable"):
        lines.append(f"state not used: {tame(data['daemon']['state_unreadable'])}")
    if not data["runs"]:
        lines.append("no sets known yet: start `skilltrain daemon` (or `skilltrain daemon --once`)")
    else:
        lines += run_lines(data["runs"], now)
    if run is not None or show_all:
        title = f"steps of {run}" if run is not None else "steps"
        lines += ["", f"{title} ({len(data['steps']):,}):", *step_lines(data["steps"], now)]
    lines += other_lines(data, now)
    lines += [""] + attention_lines(data, run=run)
    out.write("\n".join(lines) + "\n")


def other_lines(data: dict[str, Any], now: float) -> list[str]:
    """What each LLM endpoint's limiter does, the open provider batches."""
    lines = []
    endpoints = data["daemon"].get("llm_endpoints") or {}
    limits = data["daemon"].get("llm_limits") or {}
    if endpoints:
        when = "" if data["daemon"]["running"] else " (when the daemon last ran)"
        lines += ["", f"LLM endpoints{when}:"]
        lines += [f"  {tame(name, 80)}: {endpoint_text(e, now)}"
                  for name, e in sorted(endpoints.items()) if isinstance(e, dict)]
    elif limits:  # a daemon from before the endpoints were described
        lines.append("LLM calls at once: " + ", ".join(
            f"{tame(endpoint, 80)} {limit}" for endpoint, limit in sorted(limits.items())))
    batches = data.get("batches") or []
    if batches:
        lines += ["", f"open batches ({len(batches):,}):"]
        rows = [["run", "step", "batch", "state", "sets", "done", "failed", "submitted"]]
        rows += [[tame(b["run"], 40), b["step"], tame(b["batch_id"] or "(not yet)", 40),
                  b["provider_status"] or b["state"], f"{b['sets']:,}", f"{b['done']:,}",
                  f"{b['failed']:,}", "-" if b["submitted_ago_s"] is None
                  else f"{ago(now - b['submitted_ago_s'], now)} ago"] for b in batches]
        lines += columns(rows, right={4, 5, 6})
    return lines


def endpoint_text(e: dict[str, Any], now: float) -> str:
    """One endpoint's limiter in words: blocked, paced on a stated limit, adaptive, fixed."""
    limit = e.get("limit")
    if e.get("mode") == "blocked":
        text = f"BLOCKED: the provider refuses the API key ({e.get('kind')})"
        if isinstance(since := e.get("since"), int | float):
            text += f" since {clock(since)} ({ago(since, now)} ago)"
        if isinstance(due := e.get("next_probe_at"), int | float):
            text += f", next probe in {max(0, int(due - now))}s"
        return text
    if e.get("mode") == "stated":
        stated = [f"{e[k]:,} {what}" for k, what in (("requests_limit", "requests"),
                                                    ("tokens_limit", "tokens")) if e.get(k)]
        paced = e.get("paced_per_s")
        rate = f"calls started {paced:g}/s, " if isinstance(paced, int | float) else ""
        return f"pacing on the provider's stated limit ({', '.join(stated)}), " \
               f"{rate}{limit} calls at once"
    if e.get("mode") == "fixed":
        return f"{limit} calls at once (fixed)"
    return f"adaptive limit of {limit} calls at once (no limit stated)"


def daemon_line(data: dict[str, Any], now: float) -> str:
    d = data["daemon"]
    written = d["state_written_at"]
    if not d["running"]:
        last = (f" (state last written {clock(written)}, {ago(written, now)} ago)"
                if written else "; no state written yet")
        return f"{data['runs_dir']}: daemon not running{last}"
    pid = d["pid"] if d["pid"] and d["pid"] > 0 else "unknown"
    line = f"{data['runs_dir']}: daemon running (pid {pid})"
    if d["started_at"]:
        line += f" since {clock(d['started_at'])} ({ago(d['started_at'], now)} ago)"
    backlog = d["backlog"]
    if d["activity"] == "scanning":
        line += ", first scan not finished (the counts may be from before it started)"
    elif d["activity"] == "catching up":
        line += ", catching up: " + ", ".join(
            f"{backlog[s]:,} {s}" for s in ("queued", "running", "stale") if backlog[s])
    else:
        line += ", idle"
    if backlog.get("settling"):
        line += f" ({backlog['settling']:,} settling)"
    if written:
        line += f"; state written {ago(written, now)} ago"
    return line


def run_lines(runs: list[dict[str, Any]], now: float) -> list[str]:
    rows = [["run", "phase", "at", "sets done", "failed", "refused", "stuck", "spend",
             "last report"]]
    for r in runs:
        at = f"e{r['epoch']:02d}/s{r['step']:02d}" if r["epoch"] is not None else "-"
        rows.append([r["run"], tame(r["phase"], 60), at, f"{r['done']:,}/{r['sets']:,}",
                     f"{r['failed']:,}", f"{r['refused']:,}", f"{r['stuck']:,}",
                     spend_text(r), f"{ago(r['last_report_at'], now)} ago"
                     if r["last_report_at"] else "none"])
    return columns(rows, right={3, 4, 5, 6})


def spend_text(r: dict[str, Any]) -> str:
    cost = (r["spend"] or {}).get("cost_usd", 0.0)
    text = f"${cost:.4f}"
    if r["budget_usd"] is not None:
        text += f" of ${r['budget_usd']:g}"
        if cost >= r["budget_usd"]:
            text += " (budget reached)"
    return text


def step_lines(steps: list[dict[str, Any]], now: float) -> list[str]:
    rows = [["step", "sets", *_STATES, "reported", "optimizer", "last report"]]
    for s in steps:
        rows.append([s["step"], f"{s['sets']:,}", *[f"{s[k]:,}" if s[k] else "." for k in _STATES],
                     "yes" if s["reported"] else "no", s["optimizer"],
                     f"{ago(s['last_report_at'], now)} ago" if s["last_report_at"] else "-"])
    return columns(rows, right=set(range(1, 2 + len(_STATES))))


def attention_lines(data: dict[str, Any], *, run: str | None) -> list[str]:
    total, rows = data["attention_total"], data["attention"]
    where = f" in {run}" if run is not None else ""
    if not total:
        return [f"nothing needs attention{where}"]
    lines = [f"needs attention{where} ({total:,}):"]
    width = min(max(len(r["id"]) for r in rows), 64) if rows else 0
    for r in rows:
        lines.append(f"  {r['kind']:<8}  {tame(r['id']):<{width}}  {tame(r['reason'])}".rstrip())
    if (left := total - len(rows)) > 0:
        shown: dict[str, int] = {}
        for r in rows:
            shown[r["kind"]] = shown.get(r["kind"], 0) + 1
        by_kind = ", ".join(f"{n - shown.get(k, 0):,} {k}" for k in KINDS
                            if (n := data["attention_by_kind"].get(k, 0)) > shown.get(k, 0))
        lines.append(f"  ... and {left:,} more ({by_kind}): `skilltrain status --all` "
                     "lists every one, `--json` too")
    return lines


def columns(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
            for row in rows]


def tame(value: Any, limit: int = _REASON_CHARS) -> str:
    """One line of printable text: a reason must not drive the terminal or wrap the table."""
    text = " ".join(str(value).split())
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def ago(then: float, now: float) -> str:
    s = max(0, int(now - then))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def clock(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))
