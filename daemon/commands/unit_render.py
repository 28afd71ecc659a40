"""The systemd unit and logrotate rules for a workspace, rendered from their
templates.

The unit text lives in systemd/skilltrain.service.in (and the logrotate rules
in systemd/logrotate.conf), with ``@NAME@`` placeholders; this module fills
them in. Values that must agree with the code are rendered from it, never
typed twice: the exit codes that stop restarts come from ``ExitCode``, the
stop timeout from ``[daemon] shutdown_timeout_s``, the writable paths from
``[paths] runs`` and ``[log] file`` of the workspace's config.toml. A path or
account name the unit cannot spell safely is refused with ConfigError.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ..core import config
from ..core.errors import ConfigError, ExitCode

# The templates sit beside the package in the repository (editable install).
SYSTEMD_DIR = Path(__file__).resolve().parents[2] / "systemd"
UNIT_TEMPLATE = SYSTEMD_DIR / "skilltrain.service.in"
LOGROTATE_TEMPLATE = SYSTEMD_DIR / "logrotate.conf"

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
    instance: str | None = None,
) -> str:
    """The unit text for a workspace. ``user=None`` renders a per-user unit
    (``systemctl --user``): no User=/Group=, WantedBy=default.target.
    ``instance`` ([daemon] instance) names the unit's state directory
    (skilltrain-NAME) so several trainings share a host.

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
    if instance is not None and not config.INSTANCE_NAME.fullmatch(instance):
        raise ConfigError(f"instance name {instance!r}: letters, digits, '.', '_', '-'")
    values = {
        "UNIT": config.unit_name(instance),
        "WORKSPACE_DESCRIPTION": (f"instance {instance}, " if instance else "")
        + _unit_path(workspace, "workspace"),
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
