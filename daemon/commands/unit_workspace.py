"""What `skilltrain install-service` reads from the workspace and the host:
the paths and timeout from config.toml, the default service user, and the
problems that would only show up at `systemctl start`.
"""

from __future__ import annotations

import grp
import os
import pwd
import sys
from dataclasses import dataclass
from pathlib import Path

from ..core import config
from ..core.errors import ConfigError
from .unit_render import ENV_FILE


@dataclass(frozen=True)
class WorkspaceSettings:
    """What the unit needs from the workspace's config.toml (defaults if absent)."""

    config_found: bool
    runs: Path
    data: Path
    prompts: Path
    log_file: Path | None
    shutdown_timeout_s: float
    instance: str | None = None  # [daemon] instance

    @classmethod
    def read(cls, workspace: Path) -> WorkspaceSettings:
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
            instance=cfg.daemon.instance,
        )

    def extra_write_dirs(self) -> list[Path]:
        """The log's directory, when the log lives outside runs/."""
        if self.log_file is None:
            return []
        log_dir = self.log_file.parent
        if log_dir == self.runs or self.runs in log_dir.parents:
            return []
        return [log_dir]


def workspace_owner(workspace: Path) -> str:
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


def primary_group(user: str) -> str:
    try:
        return grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name
    except KeyError:
        return user


def warn_about_host(user: str | None, settings: WorkspaceSettings) -> None:
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
