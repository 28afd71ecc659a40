"""`skilltrain install-service`: render the systemd unit for a workspace,
write it (and optionally logrotate rules), enable it, and print the next steps.

Rendering is unit_render's; what the workspace and host provide is
unit_workspace's.
"""

from __future__ import annotations

import argparse
import os
import pwd
import subprocess
import sys
from pathlib import Path
from typing import TextIO

from ..core import config
from ..core.errors import ConfigError, ExitCode, SkilltrainError
from .unit_render import ENV_FILE, render_logrotate, render_unit
from .unit_workspace import (
    WorkspaceSettings,
    primary_group,
    warn_about_host,
    workspace_owner,
)

SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
SYSTEM_UNIT_PATH = SYSTEM_UNIT_DIR / "skilltrain.service"
LOGROTATE_DIR = Path("/etc/logrotate.d")
LOGROTATE_PATH = LOGROTATE_DIR / "skilltrain"


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
    p.add_argument(
        "--name",
        metavar="NAME",
        help="instance name, for several trainings on one host: the unit becomes "
        "skilltrain-NAME.service, its state /var/lib/skilltrain-NAME, its logrotate file "
        "skilltrain-NAME (default: [daemon] instance of config.toml; none: skilltrain)",
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
        "--logrotate",
        action="store_true",
        help=f"also write them to {LOGROTATE_DIR}/ under the unit's name",
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
    settings = WorkspaceSettings.read(workspace)
    instance = _instance(args.name, settings)
    unit_name = config.unit_name(instance)
    user = None if args.user_unit else (args.user or workspace_owner(workspace))
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
        instance=instance,
    )
    warn_about_host(user, settings)
    # With --print, stdout is the unit alone, so `--print > file` works.
    report = sys.stderr if args.print else sys.stdout
    if args.print:
        sys.stdout.write(unit)
        target = None
    else:
        target = args.output or _default_output(args.user_unit, unit_name)
        _write(target, unit, report)
    if args.logrotate and args.logrotate_output:
        raise ConfigError("--logrotate writes to /etc/logrotate.d/: drop --logrotate-output")
    if args.logrotate_output or args.logrotate:
        rules_path = args.logrotate_output or LOGROTATE_DIR / unit_name
        _write_logrotate(rules_path, settings.log_file, user, args.group, report)
    name = target.stem if target is not None and target.suffix == ".service" else unit_name
    if args.enable:
        code = _enable(name, user_unit=args.user_unit)
        if code != ExitCode.OK:
            return code
    _print_next_steps(name, workspace, user_unit=args.user_unit, enabled=args.enable,
                      state=_state_path(unit_name, args.user_unit), stream=report)
    return int(ExitCode.OK)


def _instance(name: str | None, settings: WorkspaceSettings) -> str | None:
    """--name, or [daemon] instance; they must agree, so status and tail name the unit."""
    if name is not None and not config.INSTANCE_NAME.fullmatch(name):
        raise ConfigError(f"--name {name!r}: 1-64 letters, digits, '.', '_', '-', "
                          "starting with a letter or digit")
    if name is not None and settings.instance is not None and name != settings.instance:
        raise ConfigError(f"--name {name} but config.toml has [daemon] instance = "
                          f"{settings.instance!r}: use one name")
    if name is not None and settings.instance is None:
        print(f"warning: add `instance = \"{name}\"` under [daemon] in config.toml, so "
              "`skilltrain status` and `tail` say which instance they read", file=sys.stderr)
    return name or settings.instance


def _default_output(user_unit: bool, unit_name: str = "skilltrain") -> Path:
    if not user_unit:
        return SYSTEM_UNIT_DIR / f"{unit_name}.service"
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(config_home) / "systemd" / "user" / f"{unit_name}.service"


def _write_logrotate(
    path: Path, log_file: Path | None, user: str | None, group: str | None, report: TextIO
) -> None:
    if log_file is None:
        print("warning: [log] file is not set: no logrotate rules written", file=sys.stderr)
        return
    # A user unit runs as whoever installs it; logrotate must rotate as them too.
    owner = user or pwd.getpwuid(os.getuid()).pw_name
    rules = render_logrotate(log_file=log_file, user=owner, group=group or primary_group(owner))
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


def _state_path(unit_name: str, user_unit: bool) -> Path:
    """Where the unit's StateDirectory= puts the state (%S: /var/lib, ~/.local/state)."""
    if not user_unit:
        return Path("/var/lib") / unit_name / "state.sqlite3"
    state_home = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state_home) / unit_name / "state.sqlite3"


def _print_next_steps(
    name: str, workspace: Path, *, user_unit: bool, enabled: bool, state: Path, stream: TextIO
) -> None:
    systemctl = " ".join(_systemctl(user_unit))
    journal = "journalctl --user" if user_unit else "journalctl"
    env_file = "~/.config/skilltrain/env" if user_unit else ENV_FILE
    steps = [] if enabled else [f"{systemctl} daemon-reload", f"{systemctl} enable --now {name}"]
    steps += [
        f"{journal} -u {name} -f",
        f"skilltrain tail --follow --config {workspace / 'config.toml'}",
        # The service's state is in its StateDirectory=, not under runs/.
        f"SKILLTRAIN_STATE={state} skilltrain status --config {workspace / 'config.toml'}",
    ]
    print(f"API keys (e.g. OPENAI_API_KEY=...) go in {env_file}, mode 0600.", file=stream)
    print("Next steps:\n" + "".join(f"  {s}\n" for s in steps), end="", file=stream)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SkilltrainError as e:
        print(f"skilltrain install-service: {e}", file=sys.stderr)
        sys.exit(int(e.exit_code))
