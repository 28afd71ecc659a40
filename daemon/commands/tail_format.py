"""`skilltrain tail`'s line for one event:

  09:12:07   loss.completed      r7/e01/s02 alice r01-03   in=18211 out=1034 cached=0 $0.0123 41.2s

time (local), level mark, event name, where (`run/eEE/sSS work rFF-LL`), then
the fields that matter for that event; events without a formatter of their
own show their other fields as key=value. Free text is cut and escaped: an
optimizer's output must not drive the terminal.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from datetime import datetime
from typing import Any

EVENT_WIDTH = 18  # len("optimizer.finished")
WHERE_MIN_WIDTH = 24
_MAX_TEXT = 200  # free text (messages, reasons, exceptions) per line

# Fields shown in the location column or not at all.
_PLACED = frozenset(
    {
        "timestamp",
        "level",
        "event",
        "logger",
        "run",
        "epoch",
        "step",
        "work",
        "range",
        "job_id",
        "exception",
    }
)
_LEVEL_MARK = {"debug": "d", "info": " ", "warning": "W", "error": "E", "critical": "E"}

Record = dict[str, Any]


def _text(value: Any, limit: int = _MAX_TEXT) -> str:
    text = str(value)
    if not text.isprintable():
        # Escape control characters: an optimizer's output must not drive the terminal.
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kv(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key}={value:g}"
    if isinstance(value, str) and value and not any(c.isspace() or c == '"' for c in value):
        return f"{key}={_text(value)}"
    if isinstance(value, str):
        return f"{key}={json.dumps(_text(value), ensure_ascii=False)}"
    if isinstance(value, list | dict):
        return f"{key}={_text(json.dumps(value, ensure_ascii=False))}"
    return f"{key}={value}"


def _secs(ms: Any) -> str:
    if not isinstance(ms, int | float):
        return "?s"
    if ms < 1000:
        return f"{int(ms)}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def usd(value: Any) -> str:
    return f"${value:.4f}" if isinstance(value, int | float) else "$?"


def _clock(timestamp: Any) -> str:
    # The log is UTC; the operator's terminal (like journalctl) shows local time.
    try:
        return datetime.fromisoformat(str(timestamp)).astimezone().strftime("%H:%M:%S")
    except ValueError:
        return "??:??:??"


def _two(value: Any) -> str:
    return f"{value:02d}" if isinstance(value, int) else str(value)


def where(rec: Record) -> str:
    """`run/eEE/sSS work rFF-LL`, whichever parts the record has."""
    parts = []
    if rec.get("run") is not None:
        path = str(rec["run"])
        if rec.get("epoch") is not None:
            path += f"/e{_two(rec['epoch'])}"
            if rec.get("step") is not None:
                path += f"/s{_two(rec['step'])}"
        parts.append(path)
    if rec.get("work") is not None:
        parts.append(str(rec["work"]))
    if rec.get("range") is not None:
        parts.append(f"r{rec['range']}")
    return " ".join(parts)


def _rest(rec: Record, *skip: str) -> list[str]:
    return [_kv(k, v) for k, v in rec.items() if k not in _PLACED and k not in skip]


def tokens_text(rec: Record) -> str:
    """`in=.. out=.. cached=..` (`cache_write=..` when there are some): an event, a spend."""
    return " ".join(
        f"{k}={rec[f'tokens_{k}']}"
        for k in ("in", "out", "cached", "cache_write")
        # Cache writes happen on Anthropic-style caching only: shown when there are some.
        if rec.get(f"tokens_{k}") is not None and (k != "cache_write" or rec[f"tokens_{k}"])
    )


def _f_loss_completed(rec: Record) -> list[str]:
    if rec.get("reused_from"):  # a retired report back, unpaid (pipeline.reuse)
        return ["its retired report back (same inputs), unpaid"]
    parts = [tokens_text(rec), usd(rec.get("cost_usd")), _secs(rec.get("duration_ms"))]
    if rec.get("leaks_redacted"):
        parts.append(f"leaks_redacted={rec['leaks_redacted']}")
    if isinstance(rec.get("attempts"), int) and rec["attempts"] > 1:
        parts.append(f"attempts={rec['attempts']}")
    if (claims := _claims(rec)) is not None:
        parts.append(claims)
    return parts


def _claims(rec: Record) -> str | None:
    """The report's claims checked against the measurements (docs/grounded-reports.md)."""
    status = rec.get("claims_status")
    if status is None:
        return None  # a line of a daemon from before claims were checked
    if status != "checked":
        return f"claims={status.replace('_', '-')}"
    text = (f"claims={rec.get('claims_confirmed', 0)}ok/"
            f"{rec.get('claims_contradicted', 0)}contradicted")
    if rec.get("claims_not_checkable"):
        text += f"/{rec['claims_not_checkable']}unknown"
    return text


def _f_loss_contradicted(rec: Record) -> list[str]:
    return [*_f_loss_failed(rec), *filter(None, [_claims(rec)])]


def _f_loss_failed(rec: Record) -> list[str]:
    retry = rec.get("next_retry_s")
    then = "no retry" if retry is None else f"retry in {_secs(float(retry) * 1000)}"
    return [_kv("reason", rec.get("reason")), f"attempts={rec.get('attempts', '?')}", then]


def _f_loss_started(rec: Record) -> list[str]:
    tokens = rec.get("prompt_tokens")
    return [f"prompt={rec.get('prompt_chars', '?')}ch/{'?' if tokens is None else tokens}tok"]


def _f_loss_retry(rec: Record) -> list[str]:
    wait = rec.get("wait_s")
    return [
        f"attempt={rec.get('attempt', '?')}",
        f"wait={_secs(float(wait) * 1000) if isinstance(wait, int | float) else '?'}",
        _kv("error", rec.get("error", "")),
    ]


def _f_step_reported(rec: Record) -> list[str]:
    distance, change = rec.get("craft_distance"), rec.get("craft_distance_change")
    parts = [f"sets={rec.get('sets', '?')}"]
    if isinstance(distance, int | float):
        parts.append(f"distance={distance:.4f}")
        parts.append(f"change={change:+.4f}" if isinstance(change, int | float) else "change=-")
    if isinstance(share := rec.get("claims_contradicted_share"), int | float):
        parts.append(f"contradicted={share:.0%}")
    return [*parts, _kv("reports", rec.get("reports_dir", "?"))]


def _f_optimizer_started(rec: Record) -> list[str]:
    argv = rec.get("argv")
    return ["$ " + (shlex.join(map(str, argv)) if isinstance(argv, list) else str(argv))]


def _f_optimizer_output(rec: Record) -> list[str]:
    return [f"{rec.get('stream', '?')}| {_text(rec.get('line', ''))}"]


def _f_optimizer_finished(rec: Record) -> list[str]:
    return [f"exit={rec.get('exit_code', '?')}", _secs(rec.get("duration_ms"))]


def _f_scan_completed(rec: Record) -> list[str]:
    return [*_rest(rec, "duration_ms"), _secs(rec.get("duration_ms"))]


def _f_budget_reached(rec: Record) -> list[str]:
    return [f"spent {usd(rec.get('spent_usd'))} of {usd(rec.get('budget_usd'))}"]


def _f_cost_total(rec: Record) -> list[str]:
    return [tokens_text(rec), usd(rec.get("cost_usd"))]


def _f_audit_leak(rec: Record) -> list[str]:
    episode = rec.get("episode")
    return [
        f"{rec.get('file', '?')}:{rec.get('line', '?')}",
        f"ep{_two(episode)}",
        f"n_words={rec.get('n_words', '?')}",
    ]


def _f_llm_limit_changed(rec: Record) -> list[str]:
    reason = _text(rec.get("reason", ""), 40)
    if isinstance(rec.get("rate_per_s"), int | float):
        reason += f": {rec['rate_per_s']:g}/s"
    return [f"{rec.get('endpoint', '?')} limit {rec.get('previous', '?')} -> "
            f"{rec.get('limit', '?')}", f"({reason})",
            f"in_flight={rec.get('in_flight', '?')}"]


def _f_llm_held(rec: Record) -> list[str]:
    wait = rec.get("wait_s")
    held = _secs(float(wait) * 1000) if isinstance(wait, int | float) else "?"
    return [f"{rec.get('endpoint', '?')} held {held}", f"({_text(rec.get('reason', ''), 40)})",
            f"limit={rec.get('limit', '?')}"]


def _f_llm_pacing(rec: Record) -> list[str]:
    def figure(key: str) -> str | None:
        was, now = rec.get(f"previous_{key}"), rec.get(key)
        what = key.removesuffix("_limit")
        if rec.get("change") == "changed" and was and now and was != now:
            return f"{was} -> {now} {what}"
        return f"{now} {what}" if now else None

    endpoint = rec.get("endpoint", "?")
    if rec.get("change") == "gone":
        was = rec.get("previous_requests_limit")
        return [f"{endpoint} the provider states no limit any more"
                + (f" (was {was} requests)" if was else "") + ":",
                f"adaptive, {rec.get('limit', '?')} calls at once"]
    stated = [f for f in (figure("requests_limit"), figure("tokens_limit")) if f]
    line = [f"{endpoint} pacing on the provider's stated limit:", ", ".join(stated) or "?"]
    if rec.get("previous") not in (None, rec.get("limit")):
        line.append(f"(calls at once {rec.get('previous')} -> {rec.get('limit')})")
    return line


def _f_llm_flex_unavailable(rec: Record) -> list[str]:
    return [f"{rec.get('model', '?')}: flex has no capacity (429 Resource Unavailable);",
            _text(rec.get("action", "?"))]


def _f_llm_flex_available(rec: Record) -> list[str]:
    gone = rec.get("unavailable_s")
    after = _secs(float(gone) * 1000) if isinstance(gone, int | float) else "?"
    return [f"{rec.get('model', '?')}: flex served again after {after};",
            f"refused={rec.get('refused', '?')} fell_back={rec.get('fell_back', '?')} "
            f"waited={rec.get('waited', '?')}"]


_FIELDS: dict[str, Callable[[Record], list[str]]] = {
    "loss.completed": _f_loss_completed,
    "loss.failed": _f_loss_failed,
    "loss.contradicted": _f_loss_contradicted,
    "loss.rate_limited": _f_loss_failed,
    "llm.limit_changed": _f_llm_limit_changed,
    "llm.held": _f_llm_held,
    "llm.pacing": _f_llm_pacing,
    "llm.flex_unavailable": _f_llm_flex_unavailable,
    "llm.flex_available": _f_llm_flex_available,
    "loss.started": _f_loss_started,
    "loss.retry": _f_loss_retry,
    "step.reported": _f_step_reported,
    "optimizer.started": _f_optimizer_started,
    "optimizer.output": _f_optimizer_output,
    "optimizer.finished": _f_optimizer_finished,
    "scan.completed": _f_scan_completed,
    "budget.reached": _f_budget_reached,
    "cost.total": _f_cost_total,
    "audit.leak": _f_audit_leak,
}


def _exception(rec: Record) -> str:
    stacks = rec.get("exception")
    if isinstance(stacks, list) and stacks and isinstance(stacks[0], dict):
        top = stacks[0]
        return f"[{top.get('exc_type', '?')}: {_text(top.get('exc_value', ''))}]"
    if isinstance(stacks, str):  # a text traceback: its last line names the error
        return f"[{_text(stacks.strip().splitlines()[-1])}]" if stacks.strip() else ""
    return ""


def format_event(rec: Record, where_width: int = WHERE_MIN_WIDTH) -> str:
    """One readable line: `HH:MM:SS L event  run/eEE/sSS work rFF-LL  fields`."""
    name = str(rec.get("event", ""))
    fields = _FIELDS.get(name, _rest)(rec)
    loc = where(rec)
    fields = [f for f in (*fields, _exception(rec)) if f]
    mark = _LEVEL_MARK.get(str(rec.get("level", "")).lower(), "?")
    line = f"{_clock(rec.get('timestamp'))} {mark} {_text(name):<{EVENT_WIDTH}}  "
    line += f"{loc:<{where_width}}  {' '.join(fields)}"
    return line.rstrip()
