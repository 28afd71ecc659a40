"""The structured log: structlog routed through stdlib logging, configured once.

Every line is one JSON object (`timestamp` UTC ISO 8601, `level`, `event`, fields)
in the log file and, when stderr is not a terminal, on stderr for journald. The
log is the operator's interface and `skilltrain tail` parses it, so event names
and fields are a stable API: see docs/events.md.

Two things must never reach a line: API keys (scrubbed from every field, from
exception text, and by value for the keys configured in the environment) and
the human screenplay. For the screenplay, at every level, debug included:

- tracebacks render without local variables, where a prompt would sit;
- our own events never carry prompt or reply text, only sizes and hashes;
- a record of a library (litellm, httpx, openai, ...) below INFO is reduced
  to `library.withheld` with its logger, level, size and sha256: at debug
  litellm logs whole requests and replies. So is every library record while
  the process has no answer keys installed (the log is configured before the
  daemon reads the works, and it cannot check what it cannot compare with);
- the last step before a line is written checks every string of it (fields,
  exception text, library messages) against the answer keys of every work
  (`leakguard.install`, called by the daemon once it has read them) and
  redacts what it finds, in any encoding textnorm decodes.

Context bound with `bound_job` appears in every line logged inside it;
worker threads do not inherit it, so a job binds its own.

Cheap to import: structlog, the standard library and the leak guard only.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import logging.handlers
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal, TextIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer
from structlog.typing import EventDict, Processor, WrappedLogger

from ..core.dataset import format_range
from ..core.log_scrub import scrub, scrub_secrets
from ..core.short_memo import NO_TEXT_TYPES, ShortStringMemo, is_stamp
from ..guard import leakguard

__all__ = [
    "LEVELS",
    "adopt_library_loggers",
    "bound_job",
    "configure",
    "get_logger",
    "scrub",
    "scrub_secrets",
    "shutdown",
]

LEVELS: Mapping[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

# Chatty at INFO (one line per HTTP request, per job run, per inotify event).
NOISY_LOGGERS = (
    "LiteLLM",
    "LiteLLM Router",
    "LiteLLM Proxy",
    "httpx",
    "httpcore",
    "openai",
    "apscheduler",
    "watchdog",
)

_MAX_EXC_VALUE = 1000

# Keys first in every JSON line, so `cat` and `grep` read naturally.
_KEY_ORDER = ("timestamp", "level", "event", "run", "epoch", "step", "work", "range", "job_id")

_handlers: list[logging.Handler] = []
_AFTER_SHUTDOWN = logging.NullHandler()  # on the root between shutdown() and configure()
_structlog_ready = False


def _cap_exception_text(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    """Cap `exc_value`: a provider's error may echo a long span of the prompt back.
    (A traceback rendered to text, as the console has it: each line of it.)"""
    exception = event_dict.get("exception")
    if isinstance(exception, str):
        event_dict["exception"] = "\n".join(_cap(line) for line in exception.split("\n"))
        return event_dict
    for stack in exception or ():
        if isinstance(stack, dict) and isinstance(stack.get("exc_value"), str):
            stack["exc_value"] = _cap(stack["exc_value"])
    return event_dict


def _cap(value: str) -> str:
    if len(value) <= _MAX_EXC_VALUE:
        return value
    return f"{value[:_MAX_EXC_VALUE]}... [{len(value) - _MAX_EXC_VALUE} chars cut]"


# ------------------------------------------------------------------ the answer key


WITHHELD_EVENT = "library.withheld"
_OWN_LOGGERS = ("skilltrain",)


def _withhold_library_records(_logger: WrappedLogger, _name: str,
                              event_dict: EventDict) -> EventDict:
    """A library's record below INFO, or before the answer keys are known: its size and hash.

    Runs first in the formatters, where `_record` is still there. litellm at
    debug logs every request (the prompt, hence the human text) and reply.
    """
    record = event_dict.get("_record")
    if _is_own(event_dict) or not isinstance(record, logging.LogRecord):
        return event_dict
    if record.name.startswith(_OWN_LOGGERS):
        return event_dict
    if record.levelno >= logging.INFO and leakguard.installed() is not None:
        return event_dict  # checked by _seal_answer_key like every line
    message = str(event_dict.get("event", ""))
    kept = {key: event_dict[key] for key in ("timestamp", "_record", "_from_structlog")
            if key in event_dict}
    return {
        **kept,
        "event": WITHHELD_EVENT,
        "level": record.levelname.lower(),
        "logger": record.name,
        "chars": len(message),
        "sha256": hashlib.sha256(message.encode("utf-8", "surrogatepass")).hexdigest()[:16],
        **({"exc_type": record.exc_info[0].__name__}
           if record.exc_info and record.exc_info[0] is not None else {}),
    }


# Short strings repeat on every line: their sealed text is kept, per set of
# answer keys.
_sealed = ShortStringMemo(max_chars=120, max_entries=4096)


def _seal_str(text: str, keys: leakguard.AnswerKeys) -> str:
    return _sealed.get(text, keys, _clean)


def _clean(text: str, keys: leakguard.AnswerKeys) -> str:
    return keys.clean(text)


def _seal(value: Any, keys: leakguard.AnswerKeys) -> Any:
    if isinstance(value, str):
        return _seal_str(value, keys)
    if type(value) in NO_TEXT_TYPES:  # most other fields: no ABC check for them
        return value
    if isinstance(value, Mapping):
        return {key: _seal(item, keys) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_seal(item, keys) for item in value]
    return value


def _seal_answer_key(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    """Last before rendering: every string of the line checked against every work."""
    keys = leakguard.installed()
    if keys is None or not keys.indexes:
        return event_dict
    # The stamp is the log's own (short_memo.is_stamp): every other string is sealed.
    return {key: value if is_stamp(key, value) else _seal(value, keys)
            for key, value in event_dict.items()}


def _order_keys(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    first = {key: event_dict.pop(key) for key in _KEY_ORDER if key in event_dict}
    first.update(event_dict)
    return first


# ------------------------------------------------------------------------ configuration


def _shared_processors() -> list[Processor]:
    """Run for structlog and for foreign (stdlib) records alike."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]


def _configure_structlog() -> None:
    global _structlog_ready
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *_shared_processors(),
            structlog.processors.StackInfoRenderer(),
            # Also here, not only in our formatters: any other handler on the root
            # logger (pytest's capture, a library's) sees this dict as record.msg.
            scrub_secrets,
            _wrap_own_record,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: a module-level logger used before configure() would keep
        # structlog's defaults forever.
        cache_logger_on_first_use=False,
    )
    _structlog_ready = True


def _guarded(render_exception: Processor) -> list[Processor]:
    """What every sink runs before it renders, in this order: a library's record
    withheld, the traceback rendered, credentials scrubbed, a long error cut
    (after scrubbing: a cut must not split a key in two), the answer key sealed
    (last: it sees exactly the text that is written)."""
    return [_withhold_library_records, _remove_meta, render_exception, _scrub_new_text,
            _cap_exception_text, _seal_answer_key]


_SCRUBBED = "_skilltrain_scrubbed"
# On every record our own structlog chain makes, and nowhere else: structlog
# tells its records from others' by two attributes (_logger, _name) that any
# record can carry (a library's own structlog chain, or extra=), and such a
# record skips foreign_pre_chain, our TimeStamper with it.
_OWN_ATTR = "_skilltrain_own"
_OWN = object()


def _wrap_own_record(logger: WrappedLogger, name: str,
                     event_dict: EventDict) -> tuple[tuple[EventDict], dict[str, Any]]:
    """ProcessorFormatter.wrap_for_formatter, the record marked as ours."""
    args, kwargs = structlog.stdlib.ProcessorFormatter.wrap_for_formatter(
        logger, name, event_dict)
    kwargs["extra"][_OWN_ATTR] = _OWN
    return args, kwargs


def _is_own(event_dict: EventDict) -> bool:
    """Did the line come through our structlog chain (scrubbed and stamped there)?"""
    return getattr(event_dict.get("_record"), _OWN_ATTR, None) is _OWN


def _remove_meta(logger: WrappedLogger, name: str, event_dict: EventDict) -> EventDict:
    """ProcessorFormatter.remove_processors_meta, noting that a line of ours
    (_is_own) passed scrub_secrets in structlog's chain already."""
    ours = _is_own(event_dict)
    event_dict = structlog.stdlib.ProcessorFormatter.remove_processors_meta(
        logger, name, event_dict)
    if ours:
        event_dict[_SCRUBBED] = True
    return event_dict


def _scrub_new_text(logger: WrappedLogger, name: str, event_dict: EventDict) -> EventDict:
    """Credentials scrubbed from the text that is new here: a library's record,
    a traceback just rendered. A line of ours without one was scrubbed in the
    chain (_configure_structlog), and walking its fields again cost a third
    of a line's time."""
    if event_dict.pop(_SCRUBBED, False) and "exception" not in event_dict:
        return event_dict
    return scrub_secrets(logger, name, event_dict)


def _json_formatter() -> logging.Formatter:
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_shared_processors(),
        processors=[
            # Locals off: a frame's locals would carry the prompt and the API key.
            *_guarded(structlog.processors.ExceptionRenderer(
                ExceptionDictTransformer(show_locals=False))),
            _order_keys,
            structlog.processors.JSONRenderer(ensure_ascii=False),
        ],
    )


def _console_formatter() -> logging.Formatter:
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_shared_processors(),
        processors=[
            # The traceback as text (stdlib format: no locals), so the scrubber,
            # the cut and the seal see it before ConsoleRenderer prints it.
            *_guarded(structlog.processors.format_exc_info),
            structlog.dev.ConsoleRenderer(colors=True),
        ],
    )


class _RenderOnce(logging.Formatter):
    """One formatter for both sinks when both write JSON: a record is rendered
    (scrubbed, sealed against the answer keys) once, and the second handler
    writes the same text. The handlers of one logging call run one after the
    other in the calling thread, so the record itself carries the text."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self._inner = inner

    def format(self, record: logging.LogRecord) -> str:
        done = record.__dict__.get("_skilltrain_rendered")
        if done is not None and done[0] is self:
            text: str = done[1]
            return text
        text = self._inner.format(record)
        record.__dict__["_skilltrain_rendered"] = (self, text)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        """As each handler's filter: the line is rendered before the handler
        takes its lock, so threads logging at once do not queue behind one
        another's rendering (the leak check of every field), only its write."""
        with contextlib.suppress(Exception):  # emit renders again, and reports it
            self.format(record)
        return True


def _wants_console(stderr: TextIO, stderr_format: str) -> bool:
    if stderr_format == "auto":
        isatty = getattr(stderr, "isatty", None)
        return bool(isatty and isatty())
    return stderr_format == "console"


class _ResilientFileHandler(logging.handlers.WatchedFileHandler):
    """WatchedFileHandler that survives its folder being deleted.

    The default log file lives in runs/; if runs/ is deleted, the stock
    handler's reopen raises FileNotFoundError out of every logging call (it
    runs outside emit's error handling) and takes the daemon down with it.
    This one recreates the folder, and a write that still fails is reported
    by logging's handleError instead of raised into our code.
    """

    _closed = False

    def _open(self) -> Any:
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()

    def emit(self, record: logging.LogRecord) -> None:
        # A thread that took this handler before shutdown() removed it (a late
        # audit line) must not reopen the file that close() just closed: no
        # one would close it again.
        if self._closed:
            return
        try:
            super().emit(record)
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        self.acquire()
        try:
            self._closed = True
            super().close()
        finally:
            self.release()


def configure(
    *,
    log_file: Path | None,
    level: str = "info",
    stderr: TextIO = sys.stderr,
    stderr_format: Literal["auto", "json", "console"] = "auto",
) -> None:
    """Route every log line to `log_file` (JSON lines) and to `stderr`.

    Safe to call again: the handlers of the previous call are closed and replaced.
    JSON on stderr unless it is a terminal ("auto"); colours on a terminal.
    """
    if level.lower() not in LEVELS:
        raise ValueError(f"log level {level!r}: allowed {', '.join(LEVELS)}")
    if stderr_format not in ("auto", "json", "console"):
        raise ValueError(f"stderr_format {stderr_format!r}: allowed auto, json, console")
    numeric = LEVELS[level.lower()]
    _configure_structlog()
    _skip_unused_record_fields()

    shutdown()
    root = logging.getLogger()
    root.removeHandler(_AFTER_SHUTDOWN)
    json_lines = _RenderOnce(_json_formatter())
    console = logging.StreamHandler(stderr)
    if _wants_console(stderr, stderr_format):
        console.setFormatter(_console_formatter())
    else:
        console.setFormatter(json_lines)
        console.addFilter(json_lines)
    _handlers.append(console)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        # WatchedFileHandler reopens the path when logrotate renames the file.
        # backslashreplace: a folder name that is not UTF-8 must not cost the line.
        file_handler = _ResilientFileHandler(log_file, encoding="utf-8",
                                             errors="backslashreplace")
        file_handler.setFormatter(json_lines)
        file_handler.addFilter(json_lines)
        _handlers.append(file_handler)
    for handler in _handlers:
        root.addHandler(handler)
    root.setLevel(numeric)

    noisy_level = logging.NOTSET if numeric <= logging.DEBUG else logging.WARNING
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(noisy_level)
    adopt_library_loggers()


def _skip_unused_record_fields() -> None:
    """No line shows a record's caller, thread or process: stdlib logging is
    told not to look them up for every record (the logging HOWTO's
    "Optimization" table; the caller is a walk up the stack per line)."""
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def shutdown() -> None:
    """Flush, detach and close the handlers configure() installed. A line after
    this (a thread's, at exit) goes nowhere: with no handler at all, logging's
    lastResort would print its fields to stderr unsealed."""
    root = logging.getLogger()
    for handler in _handlers:
        root.removeHandler(handler)
        handler.close()
    _handlers.clear()
    root.addHandler(_AFTER_SHUTDOWN)


def adopt_library_loggers() -> None:
    """Strip the handlers litellm installs on its own loggers at import.

    litellm writes its records itself (some to stdout) and also lets them reach
    the root logger, so every line would appear twice, once unscrubbed. Call this
    right after the lazy `import litellm`; configure() calls it too.
    """
    for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):
        lib_logger = logging.getLogger(name)
        for handler in list(lib_logger.handlers):
            lib_logger.removeHandler(handler)
        lib_logger.propagate = True


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    """A structlog logger writing through the handlers configure() installed.

    Bound here, not a lazy proxy: a proxy binds anew (and asks logging for the
    logger by name) at every call. Safe because structlog is configured once,
    just above, and never again; configure() only swaps the handlers."""
    if not _structlog_ready:
        _configure_structlog()
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name).bind()
    return logger


# ----------------------------------------------------------------------------- context


@contextlib.contextmanager
def bound_job(**ctx: Any) -> Iterator[None]:
    """Bind `ctx` (run, epoch, step, work, range, job_id, ...) for the block.

    A `range` given as (first, last) is formatted as "01-03". The previous
    values are restored on exit, also when the block raises.
    """
    span = ctx.get("range")
    if isinstance(span, tuple) and len(span) == 2:
        ctx["range"] = format_range(*span)
    with structlog.contextvars.bound_contextvars(**ctx):
        yield


def report_task_failure(future: Future[Any]) -> None:
    """A done-callback for pool tasks (loss jobs, optimizer runs) that raised:
    in forever mode nobody asks their future, so the error is logged here."""
    if future.cancelled():
        return
    error = future.exception()
    if error is not None:
        get_logger("skilltrain.daemon").error("daemon.task_failed", error=type(error).__name__,
                                              exc_info=error)
