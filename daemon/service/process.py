"""The daemon as a process: `skilltrain daemon`'s entry, signals, exit.

    main: config -> preflight (nothing created on a bad one) -> log -> Daemon (_build)
          -> start -> run_forever (or run_once) -> shutdown -> os._exit(code)

Signal handlers only set the stop flag; a second SIGINT exits at once.
The service's life itself (start, main loop, shutdown) is daemon/service/lifecycle.py.
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from ..core import config
from ..core.errors import ConfigError, ExitCode, SkilltrainError
from ..infra import cpu, log
from .lifecycle import Daemon, preflight

# Objects made since the last collection before the collector runs (Python's
# default: 700). A job makes thousands that live until it ends (its texts'
# readings, the prompt's pieces), and each young collection walked the ones
# alive: 0.2-0.35 ms of CPU a loss job, 0.06-0.13 at this (bench/RESULTS.md,
# issue 36). Cycles wait a little longer to be freed; there are few.
YOUNG_OBJECTS = 20_000


def main(config_path: Path | None, once: bool = False) -> int:
    # No collection while litellm is imported (in Daemon): each full one walked
    # the growing import again, ~0.9 s of CPU at start-up in all.
    gc.disable()
    try:
        daemon = _build(config_path, once)
        _freeze_start_up_objects()  # litellm's import: the first scan's collections skip it
    finally:
        gc.enable()  # also when the build fails: cli.main may run inside another program
    _install_signal_handlers(daemon)
    try:
        daemon.start()
    except SkilltrainError as e:
        daemon.emit("daemon.failed", level="error", reason=str(e), exit_code=int(e.exit_code))
        e.logged = True
        daemon.abort_start()
        raise
    _freeze_start_up_objects()
    gc.set_threshold(YOUNG_OBJECTS, *gc.get_threshold()[1:])
    if once:
        daemon.run_once()
        daemon.shutdown("once: idle")
    else:
        daemon.run_forever()
        daemon.shutdown("signal" if daemon.exit_code == ExitCode.OK else "watcher died")
    # Everything is written and the lock released. Abandoned jobs sit in an
    # LLM call we cannot interrupt (their writes are atomic, so nothing is
    # partial), and litellm's exit handlers take seconds: end the process now.
    logging_flush()
    os._exit(int(daemon.exit_code))


def _build(config_path: Path | None, once: bool) -> Daemon:
    """Config, preflight (nothing created on a bad one), log, the Daemon."""
    cfg = config.load(config_path)
    if notice := config.defaults_notice(cfg):
        print(f"skilltrain: {notice}", file=sys.stderr)
    for note in cfg.renamed:
        print(f"skilltrain: warning: {note}", file=sys.stderr)
    try:
        # Before the log file (in runs/) is opened: a bad config creates nothing.
        preflight(cfg, once=once)
    except ConfigError as e:
        _log_if_possible(cfg, e)
        raise
    runs_existed = cfg.paths.runs.is_dir()
    # Before any thread is made: each inherits the CPU of the thread making it.
    pinned = cpu.pin(cfg.daemon.cpu)
    log.configure(log_file=cfg.log.file, level=cfg.log.level)
    daemon = Daemon(cfg, once=once, runs_existed=runs_existed, pinned_cpu=pinned)
    for note in cfg.renamed:
        daemon.emit("config.renamed", level="warning", note=note)
    return daemon


def _freeze_start_up_objects() -> None:
    """litellm's import, the config and the first scan leave ~1 M objects that
    live as long as the process, and every full collection walked them all
    (~130-300 ms each: at start-up, one each few hundred sets the scan queued;
    then about one per 500 jobs). Frozen, a collection walks only what is
    younger. Done after the import and again after the scan. Not collected
    first: with collection off, every object is young and one collection
    walks them all (300 ms) to find ~900 objects of garbage after the import
    and none after the scan, a bounded leak worth less than its cost."""
    gc.freeze()


def _log_if_possible(cfg: config.Config, error: SkilltrainError) -> None:
    """daemon.failed in the log file too, when its folder exists (created for
    this, it would not be "nothing created"). Marks the error as logged."""
    if cfg.log.file is None or not cfg.log.file.parent.is_dir():
        return
    log.configure(log_file=cfg.log.file, level=cfg.log.level)
    log.get_logger("skilltrain.daemon").error("daemon.failed", reason=str(error),
                                              exit_code=int(error.exit_code))
    log.shutdown()
    error.logged = True


def _install_signal_handlers(daemon: Daemon) -> None:
    def handle(signum: int, frame: FrameType | None) -> None:
        if daemon.stop_event.is_set() and signum == signal.SIGINT:
            logging_flush()
            os._exit(130)  # second Ctrl-C: the user means it
        daemon.stop_event.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    # Reload: the main loop probes blocked endpoints and scans at its next tick.
    signal.signal(signal.SIGHUP, lambda signum, frame: daemon.reload_asked.set())


def logging_flush() -> None:
    import logging

    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
