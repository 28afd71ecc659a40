"""`skilltrain install-service`: render the systemd unit for a workspace.

The unit text lives in systemd/skilltrain.service.in (and the logrotate rules
in systemd/logrotate.conf), with ``@NAME@`` placeholders; this module fills
them in. Values that must agree with the code are rendered from it, never
typed twice: the exit codes that stop restarts come from ``ExitCode``, the
stop timeout from ``[daemon] shutdown_timeout_s``, the writable paths from
``[paths] runs`` and ``[log] file`` of the workspace's config.toml.
"""

from __future__ import annotations

import argparse
import grp
import math
import os
import pwd
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from skilltrain import config
from skilltrain.errors import ConfigError, ExitCode, SkilltrainError

# The templates sit beside the package in the repository (editable install).
SYSTEMD_DIR = Path(__file__).resolve().parent.parent / "systemd"
UNIT_TEMPLATE = SYSTEMD_DIR / "skilltrain.service.in"
LOGROTATE_TEMPLATE = SYSTEMD_DIR / "logrotate.conf"

SYSTEM_UNIT_PATH = Path("/etc/systemd/system/skilltrain.service")
LOGROTATE_PATH = Path("/etc/logrotate.d/skilltrain")
# API keys: root-owned, mode 0600, read by systemd before it drops privileges.
ENV_FILE = "/etc/skilltrain/env"
# %E is $XDG_CONFIG_HOME in a user manager (and /etc in the system one).
USER_ENV_FILE = "%E/skilltrain/env"

# A restart cannot fix a bad config or a second instance.
NO_RESTART_EXIT_CODES = (ExitCode.CONFIG, ExitCode.ALREADY_RUNNING)
# systemd's SIGKILL must come after the daemon's own shutdown bound.
STOP_MARGIN_S = 30

# A per-user manager has no other identity to switch to and no CAP_SETPCAP
# to shrink the bounding set with: these lines only exist in system units.
_SYSTEM_ONLY_KEYS = frozenset({"User", "Group", "CapabilityBoundingSet", "AmbientCapabilities"})
_PLACEHOLDER = re.compile(r"@([A-Z_]+)@")
# Spaces are quoted and "%" is doubled; these would need escapes that differ
# from one unit setting to the next, so they are refused instead.
_UNSUPPORTED_IN_PATH = re.compile(r'["\\$\x00-\x1f\x7f]')
_ACCOUNT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}")
# systemd warns about these: their files are shared with every other
# "nobody" process and with NFS root-squashed files.
_SHARED_ACCOUNTS = frozenset({"nobody", "nogroup", "65534"})


def render_unit(
    *,
    workspace: Path,
    venv: Path,
    user: str | None,
    group: str | None,
    runs_dir: Path | None,
    shutdown_timeout_s: float = 60,
    watchdog_s: int = 60,
    data_dir: Path | None = None,
    prompts_dir: Path | None = None,
    extra_write_dirs: Sequence[Path] = (),
    template: Path = UNIT_TEMPLATE,
) -> str:
    """The unit text for a workspace. ``user=None`` renders a per-user unit
    (``systemctl --user``): no User=/Group=, WantedBy=default.target.

    ``runs_dir`` (default workspace/runs) and ``extra_write_dirs`` are the
    only writable paths; ``data_dir``/``prompts_dir`` default to the
    workspace's data/ and prompts/. Raises ConfigError for a relative path,
    a path the unit cannot spell, or a writable path that holds the workspace.
    """
    if shutdown_timeout_s < 0 or watchdog_s < 0:
        raise ConfigError("shutdown_timeout_s and watchdog_s must be >= 0")
    workspace = _absolute(workspace, "workspace")
    venv = _absolute(venv, "venv")
    writable = _unique(
        _absolute(p, "writable path") for p in [runs_dir or workspace / "runs", *extra_write_dirs]
    )
    for path in writable:
        if path == workspace or path in workspace.parents:
            raise ConfigError(
                f"writable path {path} holds the workspace {workspace}: the unit would "
                "let the daemon rewrite config.toml and the answer keys; use a runs/ "
                "directory (and a log file) inside it"
            )
    read_only = [data_dir or workspace / "data", prompts_dir or workspace / "prompts"]
    values = {
        "WORKSPACE": _unit_path(workspace, "workspace"),
        "VENV": _unit_path(venv, "venv"),
        "USER": "" if user is None else _account(user, "user"),
        "GROUP": "" if group is None else _account(group, "group"),
        "MOUNTS": _quoted(_unique([workspace, venv, *writable]), "path"),
        "READ_WRITE_PATHS": _quoted(writable, "writable path"),
        # "-": a missing data/ or prompts/ is the daemon's error to report, not a start failure.
        "READ_ONLY_PATHS": _quoted(read_only, "read-only path", prefix="-"),
        "RESTART_PREVENT_EXIT_STATUS": " ".join(str(int(c)) for c in NO_RESTART_EXIT_CODES),
        "TIMEOUT_STOP_S": str(math.ceil(shutdown_timeout_s) + STOP_MARGIN_S),
        "WATCHDOG_S": str(int(watchdog_s)),
        "ENV_FILE": ENV_FILE if user is not None else USER_ENV_FILE,
        "WANTED_BY": "multi-user.target" if user is not None else "default.target",
    }
    text = _fill(template.read_text(encoding="utf-8"), values)
    if user is None:
        return _drop_keys(text, _SYSTEM_ONLY_KEYS)
    return _drop_keys(text, {"Group"}) if group is None else text


def render_logrotate(
    *, log_file: Path, user: str, group: str, template: Path = LOGROTATE_TEMPLATE
) -> str:
    """The logrotate rules for the daemon's JSON log."""
    path = str(_absolute(log_file, "log file"))
    _check_spellable(path, "log file")
    if any(c in path for c in "*?["):
        raise ConfigError(f"log file {path!r}: logrotate would read * ? [ as a glob")
    values = {
        "LOG_FILE": path,
        "USER": _account(user, "user"),
        "GROUP": _account(group, "group"),
    }
    return _fill(template.read_text(encoding="utf-8"), values)


def _absolute(path: Path, what: str) -> Path:
    if not path.is_absolute():
        raise ConfigError(f"{what} must be an absolute path, got {str(path)!r}")
    return Path(os.path.normpath(path))


def _check_spellable(text: str, what: str) -> None:
    if _UNSUPPORTED_IN_PATH.search(text) or text != text.strip():
        raise ConfigError(
            f"{what} {text!r}: quotes, backslashes, '$', control characters and leading "
            "or trailing spaces cannot go into the unit; move it to a plain path "
            "(inner spaces and '%' are fine)"
        )


def _unit_path(path: Path, what: str) -> str:
    """An absolute path as systemd reads it back: '%' starts a specifier."""
    text = str(_absolute(path, what))
    _check_spellable(text, what)
    return text.replace("%", "%%")


def _quoted(paths: Iterable[Path], what: str, prefix: str = "") -> str:
    # Quoted, because these settings are space-separated lists.
    return " ".join(f'"{prefix}{_unit_path(p, what)}"' for p in paths)


def _unique(paths: Iterable[Path]) -> list[Path]:
    return list(dict.fromkeys(paths))


def _account(name: str, what: str) -> str:
    if not _ACCOUNT_NAME.fullmatch(name):
        raise ConfigError(f"{what} {name!r} is not a valid user or group name")
    if name in _SHARED_ACCOUNTS:
        raise ConfigError(
            f"{what} {name!r} is shared with unrelated processes and files; create a "
            "dedicated one: useradd --system --user-group --home-dir /nonexistent "
            "--shell /usr/sbin/nologin skilltrain"
        )
    return name


def _fill(template: str, values: Mapping[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        try:
            return values[match.group(1)]
        except KeyError:
            raise ConfigError(f"unknown template placeholder {match.group(0)}") from None

    return _PLACEHOLDER.sub(one, template)


def _drop_keys(text: str, keys: Iterable[str]) -> str:
    drop = set(keys)
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if line.partition("=")[0].strip() not in drop)


# --- the command ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="skilltrain install-service",
        description="Render the systemd unit that runs `skilltrain daemon` for a workspace "
        "(the directory holding config.toml), write it and print the next steps.",
    )
    p.add_argument(
        "--workspace",
        required=True,
        type=Path,
        metavar="DIR",
        help="directory with config.toml, data/, prompts/, runs/",
    )
    p.add_argument(
        "--venv",
        type=Path,
        metavar="DIR",
        help="virtualenv with bin/skilltrain (default: the one running this)",
    )
    p.add_argument("--user", metavar="U", help="service user (default: owner of the workspace)")
    p.add_argument("--group", metavar="G", help="service group (default: the user's own)")
    p.add_argument(
        "--user-unit",
        action="store_true",
        help="a unit for `systemctl --user` (runs as you; no User=/Group=)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument(
        "--output",
        type=Path,
        metavar="PATH",
        help=f"unit file to write (default: {SYSTEM_UNIT_PATH}, or "
        "~/.config/systemd/user/skilltrain.service with --user-unit)",
    )
    out.add_argument("--print", action="store_true", help="print the unit instead of writing it")
    p.add_argument(
        "--logrotate-output",
        type=Path,
        metavar="PATH",
        help=f"also write logrotate rules for the JSON log (e.g. {LOGROTATE_PATH})",
    )
    p.add_argument(
        "--enable", action="store_true", help="then run systemctl daemon-reload and enable --now"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `skilltrain install-service`; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.enable and args.print:
        raise ConfigError("--enable needs the unit written: drop --print")
    if args.user_unit and (args.user or args.group):
        raise ConfigError("--user-unit runs as you: drop --user/--group")
    workspace = args.workspace.resolve()
    if not workspace.is_dir():
        raise ConfigError(f"workspace {workspace} is not a directory")
    venv = Path(os.path.abspath(args.venv or sys.prefix))
    if not os.access(venv / "bin" / "skilltrain", os.X_OK):
        raise ConfigError(
            f"{venv}/bin/skilltrain not found: pass --venv the virtualenv "
            "skilltrain is installed in"
        )
    settings = _WorkspaceSettings.read(workspace)
    user = None if args.user_unit else (args.user or _workspace_owner(workspace))
    unit = render_unit(
        workspace=workspace,
        venv=venv,
        user=user,
        group=args.group,
        runs_dir=settings.runs,
        shutdown_timeout_s=settings.shutdown_timeout_s,
        data_dir=settings.data,
        prompts_dir=settings.prompts,
        extra_write_dirs=settings.extra_write_dirs(),
    )
    _warn_about_host(user, settings)
    # With --print, stdout is the unit alone, so `--print > file` works.
    report = sys.stderr if args.print else sys.stdout
    if args.print:
        sys.stdout.write(unit)
        target = None
    else:
        target = args.output or _default_output(args.user_unit)
        _write(target, unit, report)
    if args.logrotate_output:
        _write_logrotate(args.logrotate_output, settings.log_file, user, args.group, report)
    name = target.stem if target is not None and target.suffix == ".service" else "skilltrain"
    if args.enable:
        code = _enable(name, user_unit=args.user_unit)
        if code != ExitCode.OK:
            return code
    _print_next_steps(name, workspace, user_unit=args.user_unit, enabled=args.enable, stream=report)
    return int(ExitCode.OK)


@dataclass(frozen=True)
class _WorkspaceSettings:
    """What the unit needs from the workspace's config.toml (defaults if absent)."""

    config_found: bool
    runs: Path
    data: Path
    prompts: Path
    log_file: Path | None
    shutdown_timeout_s: float

    @classmethod
    def read(cls, workspace: Path) -> _WorkspaceSettings:
        path = workspace / "config.toml"
        found = path.is_file()
        # A bad config.toml raises ConfigError here, before any unit is written.
        cfg = config.load(path) if found else config.Config()

        def inside(p: Path) -> Path:
            return p if p.is_absolute() else workspace / p

        return cls(
            config_found=found,
            runs=inside(cfg.paths.runs),
            data=inside(cfg.paths.data),
            prompts=inside(cfg.paths.prompts),
            log_file=None if cfg.log.file is None else inside(cfg.log.file),
            shutdown_timeout_s=cfg.daemon.shutdown_timeout_s,
        )

    def extra_write_dirs(self) -> list[Path]:
        """The log's directory, when the log lives outside runs/."""
        if self.log_file is None:
            return []
        log_dir = self.log_file.parent
        if log_dir == self.runs or self.runs in log_dir.parents:
            return []
        return [log_dir]


def _workspace_owner(workspace: Path) -> str:
    uid = workspace.stat().st_uid
    if uid == 0:
        raise ConfigError(
            f"workspace {workspace} belongs to root: pass --user (a dedicated service "
            "user that owns runs/; --user root only if you mean it)"
        )
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        raise ConfigError(f"workspace owner uid {uid} has no name: pass --user") from None


def _primary_group(user: str) -> str:
    try:
        return grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name
    except KeyError:
        return user


def _warn_about_host(user: str | None, settings: _WorkspaceSettings) -> None:
    """Problems that would only show up at `systemctl start`."""
    warnings = []
    if not settings.config_found:
        warnings.append("no config.toml in the workspace yet: the daemon exits 2 until it exists")
    if user is not None:
        try:
            pwd.getpwnam(user)
        except KeyError:
            warnings.append(f"user {user!r} does not exist on this machine")
    if not settings.runs.is_dir():
        warnings.append(
            f"{settings.runs} does not exist: create it, owned by the service user "
            "(ReadWritePaths= fails the start with 226/NAMESPACE otherwise)"
        )
    try:
        if os.stat(ENV_FILE).st_mode & 0o077:
            warnings.append(f"{ENV_FILE} is readable by others: chmod 600 (it holds API keys)")
    except OSError:
        pass
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)


def _default_output(user_unit: bool) -> Path:
    if not user_unit:
        return SYSTEM_UNIT_PATH
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(config_home) / "systemd" / "user" / "skilltrain.service"


def _write_logrotate(
    path: Path, log_file: Path | None, user: str | None, group: str | None, report: TextIO
) -> None:
    if log_file is None:
        print("warning: [log] file is not set: no logrotate rules written", file=sys.stderr)
        return
    # A user unit runs as whoever installs it; logrotate must rotate as them too.
    owner = user or pwd.getpwuid(os.getuid()).pw_name
    rules = render_logrotate(log_file=log_file, user=owner, group=group or _primary_group(owner))
    _write(path, rules, report)


def _write(path: Path, text: str, report: TextIO) -> None:
    """Write atomically, mode 0644, so systemd never reads half a unit."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(0o644)
        os.replace(tmp, path)
    except PermissionError as e:
        hint = "run as root, or use --print"
        raise SkilltrainError(f"cannot write {path}: {e.strerror} ({hint})") from None
    print(f"wrote {path}", file=report)


def _systemctl(user_unit: bool) -> list[str]:
    return ["systemctl", "--user"] if user_unit else ["systemctl"]


def _enable(name: str, *, user_unit: bool) -> int:
    for args in (["daemon-reload"], ["enable", "--now", name]):
        argv = _systemctl(user_unit) + args
        print("+ " + " ".join(argv), file=sys.stderr)
        try:
            done = subprocess.run(argv, check=False)
        except OSError as e:
            print(f"skilltrain install-service: cannot run systemctl: {e}", file=sys.stderr)
            return int(ExitCode.FAILURE)
        if done.returncode != 0:
            return int(ExitCode.FAILURE)
    return int(ExitCode.OK)


def _print_next_steps(
    name: str, workspace: Path, *, user_unit: bool, enabled: bool, stream: TextIO
) -> None:
    systemctl = " ".join(_systemctl(user_unit))
    journal = "journalctl --user" if user_unit else "journalctl"
    env_file = "~/.config/skilltrain/env" if user_unit else ENV_FILE
    steps = [] if enabled else [f"{systemctl} daemon-reload", f"{systemctl} enable --now {name}"]
    steps += [
        f"{journal} -u {name} -f",
        f"skilltrain tail --follow --config {workspace / 'config.toml'}",
    ]
    print(f"API keys (e.g. OPENAI_API_KEY=...) go in {env_file}, mode 0600.", file=stream)
    print("Next steps:\n" + "".join(f"  {s}\n" for s in steps), end="", file=stream)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SkilltrainError as e:
        print(f"skilltrain install-service: {e}", file=sys.stderr)
        sys.exit(int(e.exit_code))
