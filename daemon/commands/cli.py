"""`skilltrain` (also `python -m skilltrain`): the command line.

Every command module is imported when its command runs, so `--help`,
`status`, `tail` and `audit` stay fast and never import litellm.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..core.errors import SkilltrainError

Command = Callable[[argparse.Namespace], int]


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, metavar="PATH",
                        help="config file (default: ./config.toml)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skilltrain",
        description="Hands-off skill training of an LLM screenwriter: watches runs/, "
                    "writes loss reports, triggers the optimizer.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("daemon", help="run the service in the foreground (systemd runs this)")
    _config_arg(p)
    p.add_argument("--once", action="store_true",
                   help="scan, process everything ready, wait for it, exit (cron, tests)")
    p.set_defaults(func=_daemon)

    p = sub.add_parser("loss", help="write one loss report (the one-shot step)",
                       description="Put the model's screenplay next to the human original "
                                   "and write up how they differ.")
    _config_arg(p)
    p.add_argument("--work", required=True, type=Path, help="data/<work> folder")
    p.add_argument("--scripts", required=True, type=Path, help="folder of the model's epNN.txt")
    p.add_argument("--out", required=True, type=Path, help="report file to write")
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--last", type=int, required=True)
    p.add_argument("--model", default=None, help="litellm model id (default: [llm] model)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per LLM request (default: [llm] timeout_s)")
    p.set_defaults(func=_loss)

    p = sub.add_parser("status", help="is it working, and what needs attention",
                       description="The daemon, one line per run, then what needs "
                                   "attention (failed, refused, unusable, stalled, held).")
    _config_arg(p)
    p.add_argument("run", nargs="?", default=None, metavar="RUN",
                   help="only this run, with its steps")
    p.add_argument("--all", action="store_true", dest="show_all",
                   help="every step, and everything that needs attention (no cap)")
    p.add_argument("--json", action="store_true",
                   help="machine-readable: everything, every set (docs/status.md)")
    p.set_defaults(func=_status)

    p = sub.add_parser("tail", help="readable progress from the JSON log")
    _config_arg(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep reading (survives rotation)")
    p.add_argument("--run", default=None, help="only this run")
    p.add_argument("--event", default=None, help="only events with this name or prefix")
    p.set_defaults(func=_tail)

    p = sub.add_parser("progress", help="the loss curve: craft distance per reported step")
    _config_arg(p)
    p.add_argument("run", nargs="?", default=None, metavar="RUN", help="only this run")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE",
                   help="also write the curve to FILE (.svg or .png)")
    p.set_defaults(func=_progress)

    p = sub.add_parser("start", help="begin a looped run: the daemon launches its first writer")
    _config_arg(p)
    p.add_argument("run", metavar="RUN", help="run name (runs/RUN/)")
    p.set_defaults(func=_start)

    p = sub.add_parser("batch", help="batch mode: `batch cancel RUN` cancels the run's batches")
    _config_arg(p)
    p.add_argument("action", choices=["cancel"])
    p.add_argument("run", metavar="RUN", help="run name (runs/RUN/)")
    p.add_argument("--live", action="store_true", help="do the returned sets live, now")
    p.set_defaults(func=_batch)

    p = sub.add_parser("audit", help="scan runs/ for answer-key leaks; exit 1 on a leak")
    _config_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_audit)

    p = sub.add_parser("install-service", help="render the systemd unit for a workspace",
                       add_help=False)
    p.set_defaults(func=_install_service)
    return parser


def _check_loss_range(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A range that cannot exist is a bad command line (exit 2), said before any work."""
    if args.first < 0 or args.last < 0:
        parser.error(f"--first {args.first} --last {args.last}: episode numbers are 0 or more")
    if args.first > args.last:
        parser.error(f"--first {args.first} --last {args.last}: --first must not be after "
                     "--last (both inclusive: --first 1 --last 3 is ep01-ep03)")


def _loss(args: argparse.Namespace) -> int:
    from . import loss_command

    return loss_command.main(args)


def _daemon(args: argparse.Namespace) -> int:
    from ..service import process

    return process.main(config_path=args.config, once=args.once)


def _status(args: argparse.Namespace) -> int:
    from . import status

    return status.main(config_path=args.config, as_json=args.json, run=args.run,
                       show_all=args.show_all)


def _tail(args: argparse.Namespace) -> int:
    from ..core import config
    from . import tail

    cfg = config.load(args.config)
    if cfg.log.file is None:
        raise SkilltrainError("[log] file is not set: there is no JSON log to tail")
    # On stderr: stdout stays the events, for grep and pipes.
    print(f"skilltrain tail: {config.describe_instance(cfg)}, log {cfg.log.file}",
          file=sys.stderr)
    return tail.main(cfg.log.file, follow=args.follow, run=args.run, event=args.event)


def _progress(args: argparse.Namespace) -> int:
    from . import progress

    return progress.main(args.config, args.run, as_json=args.json, plot=args.plot)


def _start(args: argparse.Namespace) -> int:
    from ..service import run_record

    return run_record.start_main(args.config, args.run)


def _batch(args: argparse.Namespace) -> int:
    from ..core import config
    from ..service import batch

    runs = config.load(args.config).paths.runs
    if not (runs / args.run).is_dir():
        print(f"no run {args.run!r} in {runs}", file=sys.stderr)
        return 1
    path = batch.write_cancel_file(runs, args.run, live=args.live)
    print(f"{path}: the daemon cancels the run's open batches within a second; their "
          f"unfinished sets go {'live' if args.live else 'to the next batch'}")
    return 0


def _audit(args: argparse.Namespace) -> int:
    from ..core import config, dataset
    from ..guard import audit

    cfg = config.load(args.config)
    works = {name: work.read_all_human()
             for name, work in dataset.discover_works(cfg.paths.data).items()}
    return audit.run(cfg.paths.runs, works, as_json=args.json, data_root=cfg.paths.data)


def _install_service(args: argparse.Namespace) -> int:
    from . import service_unit

    return service_unit.main(args.rest)


def main(argv: Sequence[str] | None = None) -> None:
    a_process = argv is None  # the `skilltrain` command itself, not a caller's in-process use
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["install-service"]:
        # install-service has its own parser; hand it everything after the name.
        args = argparse.Namespace(func=_install_service, rest=argv[1:])
    else:
        args = parser.parse_args(argv)
        if args.command == "loss":
            _check_loss_range(parser, args)
    try:
        code = args.func(args)
    except SkilltrainError as e:
        _report_error(args, e)
        code = e.exit_code
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        # `skilltrain status | head`: the reader left; not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    if a_process and getattr(args, "command", None) == "loss":
        # Its files are written (atomically) or refused and its lines said: end now.
        # An LLM call leaves litellm's threads and exit handlers behind, and the
        # interpreter's shutdown waits on them (seen once: a one-shot loss in CI
        # that never ended). The daemon ends the same way (process.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code))
    sys.exit(int(code))


def _report_error(args: argparse.Namespace, error: SkilltrainError) -> None:
    """The one line a failed command leaves on stderr.

    The daemon's stderr is the journal when it is not a terminal: every other
    line there is a JSON event, so this one is too (unless the daemon already
    logged it as daemon.failed).
    """
    daemon = getattr(args, "command", None) == "daemon"
    if not daemon or sys.stderr.isatty():
        print(f"skilltrain: {error}", file=sys.stderr)
    elif not error.logged:
        from ..infra import log

        event = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "Z",
                 "level": "error", "event": "daemon.failed", "reason": log.scrub(str(error)),
                 "exit_code": int(error.exit_code)}
        print(json.dumps(event, ensure_ascii=False), file=sys.stderr)


if __name__ == "__main__":
    main()
