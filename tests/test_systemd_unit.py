"""The systemd unit: rendered from the template, checked by systemd-analyze."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from skilltrain.daemon.commands import unit_render
from skilltrain.daemon.commands.service_unit import main
from skilltrain.daemon.commands.unit_render import render_logrotate, render_unit
from skilltrain.daemon.core.config import DaemonConfig
from skilltrain.daemon.core.errors import ConfigError, ExitCode

REPO = Path(__file__).resolve().parent.parent
CHECK_SCRIPT = REPO / "systemd" / "check-unit.sh"
MAX_EXPOSURE = 2.0

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


def make_venv(root: Path) -> Path:
    """A directory with an executable bin/skilltrain: all that verify looks at."""
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    exe = venv / "bin" / "skilltrain"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return venv


def make_workspace(root: Path, name: str = "ws", config: str | None = None) -> Path:
    ws = root / name
    for sub in ("runs", "data", "prompts"):
        (ws / sub).mkdir(parents=True)
    if config is not None:
        (ws / "config.toml").write_text(config)
    return ws


def setting(unit: str, key: str) -> list[str]:
    """Every value of ``key=`` in the unit, in order."""
    return [m.group(1) for m in re.finditer(rf"^{re.escape(key)}=(.*)$", unit, re.MULTILINE)]


def verify(unit_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", *args, "verify", str(unit_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def render(tmp_path: Path, **overrides: object) -> str:
    kwargs: dict[str, object] = {
        "workspace": make_workspace(tmp_path),
        "venv": make_venv(tmp_path),
        "user": "skilltrain",
        "group": "skilltrain",
        "runs_dir": None,
    }
    kwargs.update(overrides)
    return render_unit(**kwargs)


# --- the CI check ---------------------------------------------------------------------------


@needs_analyze
def test_check_unit_script_passes_and_scores_at_most_2() -> None:
    done = subprocess.run(
        ["bash", str(CHECK_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(r"system unit verified; exposure ([0-9.]+)", done.stdout)
    assert match, done.stdout
    assert float(match.group(1)) <= MAX_EXPOSURE
    assert "user unit verified" in done.stdout
    assert done.stdout.rstrip().endswith("check-unit: OK")


@needs_analyze
def test_verify_output_is_what_catches_mistakes(tmp_path: Path) -> None:
    # verify exits 0 on an unknown key: the check must gate on its output.
    unit_file = tmp_path / "skilltrain.service"
    unit = render(tmp_path)
    unit_file.write_text(unit)
    clean = verify(unit_file)
    assert (clean.returncode, clean.stdout, clean.stderr) == (0, "", "")
    unit_file.write_text(unit.replace("[Service]\n", "[Service]\nRestartPreventExitStatu=2\n"))
    broken = verify(unit_file)
    assert broken.returncode == 0
    assert "Unknown key" in broken.stderr


@needs_analyze
def test_paths_with_spaces_and_percent_survive(tmp_path: Path) -> None:
    odd = tmp_path / "my work %h"
    unit = render(tmp_path, workspace=make_workspace(odd), venv=make_venv(odd))
    assert setting(unit, "WorkingDirectory") == [f"{odd}/ws".replace("%", "%%")]
    assert setting(unit, "ReadWritePaths") == [f'"{odd}/ws/runs"'.replace("%", "%%")]
    unit_file = tmp_path / "skilltrain.service"
    unit_file.write_text(unit)
    done = verify(unit_file)
    assert (done.returncode, done.stderr) == (0, "")


@needs_analyze
def test_user_unit_verifies(tmp_path: Path) -> None:
    unit = render(tmp_path, user=None, group=None)
    for key in ("User", "Group", "CapabilityBoundingSet", "AmbientCapabilities"):
        assert setting(unit, key) == [], key
    assert setting(unit, "WantedBy") == ["default.target"]
    assert setting(unit, "EnvironmentFile") == ["-%E/skilltrain/env"]
    unit_file = tmp_path / "skilltrain.service"
    unit_file.write_text(unit)
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    done = subprocess.run(
        ["systemd-analyze", "--user", "verify", str(unit_file)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
    )
    assert (done.returncode, done.stderr) == (0, "")


# --- what the unit says -----------------------------------------------------------------------


def test_restarts_stop_on_config_errors_and_second_instances(tmp_path: Path) -> None:
    unit = render(tmp_path)
    (value,) = setting(unit, "RestartPreventExitStatus")
    codes = {int(code) for code in value.split()}
    assert int(ExitCode.CONFIG) in codes
    assert int(ExitCode.ALREADY_RUNNING) in codes
    assert int(ExitCode.WATCHER_DIED) not in codes  # that one a restart fixes
    assert setting(unit, "Restart") == ["on-failure"]


@pytest.mark.parametrize("shutdown_s", [0, 60, 61.5, 3600])
def test_systemd_waits_longer_than_the_daemon(tmp_path: Path, shutdown_s: float) -> None:
    unit = render(tmp_path, shutdown_timeout_s=shutdown_s, watchdog_s=45)
    (stop,) = setting(unit, "TimeoutStopSec")
    assert int(stop) > shutdown_s
    assert setting(unit, "WatchdogSec") == ["45"]


def test_default_shutdown_timeout_is_the_configs() -> None:
    default = inspect.signature(render_unit).parameters["shutdown_timeout_s"].default
    assert default == DaemonConfig().shutdown_timeout_s


def test_service_settings(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path)
    venv = make_venv(tmp_path)
    unit = render(tmp_path / "x", workspace=ws, venv=venv, group=None)
    assert setting(unit, "Type") == ["notify"]
    assert setting(unit, "NotifyAccess") == ["main"]
    assert setting(unit, "KillMode") == ["mixed"]
    assert setting(unit, "ExecStart") == [
        f'"{venv}/bin/skilltrain" daemon --config "{ws}/config.toml"'
    ]
    assert setting(unit, "User") == ["skilltrain"]
    assert setting(unit, "Group") == []  # None: the user's own group
    assert setting(unit, "ReadWritePaths") == [f'"{ws}/runs"']
    assert setting(unit, "ReadOnlyPaths") == [f'"-{ws}/data" "-{ws}/prompts"']
    assert setting(unit, "ProtectSystem") == ["strict"]
    assert setting(unit, "MemoryDenyWriteExecute") == ["yes"]
    assert setting(unit, "SystemCallFilter") == ["@system-service", "~@privileged @resources"]
    assert "LITELLM_LOCAL_MODEL_COST_MAP=True" in setting(unit, "Environment")[0]
    assert setting(unit, "WantedBy") == ["multi-user.target"]
    assert "@" not in "".join(re.findall(r"@[A-Z_]+@", unit))  # every placeholder filled


def test_no_secrets_in_the_unit(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path, config="")
    venv = make_venv(tmp_path)
    sentinel = "sk-sentinel-0123456789"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "skilltrain.daemon.commands.service_unit",
            "--workspace",
            str(ws),
            "--venv",
            str(venv),
            "--user",
            "skilltrain",
            "--print",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OPENAI_API_KEY": sentinel, "ANTHROPIC_API_KEY": sentinel},
    )
    assert done.returncode == 0, done.stderr
    unit = done.stdout
    assert sentinel not in unit + done.stderr
    assert setting(unit, "EnvironmentFile") == ["-/etc/skilltrain/env"]
    names = [line.partition("=")[0] for line in unit.splitlines() if "=" in line]
    assert not [n for n in names if re.search(r"(?i)key|secret|token|passw|credential", n)]
    # The only variables the unit itself sets: credentials come from the file.
    assert setting(unit, "Environment") == ["LITELLM_LOCAL_MODEL_COST_MAP=True PYTHONUNBUFFERED=1",
                                            "SKILLTRAIN_STATE=%S/skilltrain/state.sqlite3"]
    # ... the second puts the state database in the directory systemd makes for it.
    assert setting(unit, "StateDirectory") == ["skilltrain"]


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"workspace": Path("relative/ws")}, "absolute"),
        ({"venv": Path('/opt/my"venv')}, "quotes"),
        ({"venv": Path("/opt/venv\nExecStartPre=/bin/evil")}, "control"),
        ({"venv": Path("/opt/$HOME/venv")}, "'\\$'"),
        ({"user": "nobody"}, "shared"),
        ({"group": "nogroup"}, "shared"),
        ({"user": "bad user"}, "not a valid"),
        ({"shutdown_timeout_s": -1}, ">= 0"),
    ],
)
def test_refuses_what_the_unit_cannot_hold(
    tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        render(tmp_path, **overrides)


def test_refuses_a_writable_path_holding_the_workspace(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path)
    with pytest.raises(ConfigError, match="holds the workspace"):
        render(tmp_path / "x", workspace=ws, runs_dir=ws)
    with pytest.raises(ConfigError, match="holds the workspace"):
        render(tmp_path / "y", workspace=ws, extra_write_dirs=[tmp_path])


# --- the command ------------------------------------------------------------------------------


def test_main_writes_the_unit_and_prints_next_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = make_workspace(tmp_path, config="[daemon]\nshutdown_timeout_s = 100\n")
    venv = make_venv(tmp_path)
    out = tmp_path / "etc" / "skilltrain.service"
    code = main(
        ["--workspace", str(ws), "--venv", str(venv), "--user", "skilltrain", "--output", str(out)]
    )
    assert code == ExitCode.OK
    unit = out.read_text()
    assert unit == render_unit(
        workspace=ws,
        venv=venv,
        user="skilltrain",
        group=None,
        runs_dir=ws / "runs",
        shutdown_timeout_s=100,
    )
    assert setting(unit, "TimeoutStopSec") == ["130"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    printed = capsys.readouterr().out
    for step in (
        "systemctl daemon-reload",
        "systemctl enable --now skilltrain",
        "journalctl -u skilltrain -f",
        "skilltrain tail --follow",
    ):
        assert step in printed


def test_main_print_keeps_stdout_for_the_unit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = make_workspace(tmp_path, config="")
    assert (
        main(
            [
                "--workspace",
                str(ws),
                "--venv",
                str(make_venv(tmp_path)),
                "--user",
                "skilltrain",
                "--print",
            ]
        )
        == ExitCode.OK
    )
    captured = capsys.readouterr()
    assert captured.out.startswith("# skilltrain daemon")
    assert "systemctl enable" not in captured.out
    assert "systemctl enable --now skilltrain" in captured.err


def test_main_makes_configured_paths_writable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = tmp_path / "big disk"
    config = (
        f'[paths]\nruns = "{elsewhere}/runs"\ndata = "corpus"\n'
        f'[log]\nfile = "{elsewhere}/logs/skilltrain.jsonl"\n'
    )
    ws = make_workspace(tmp_path, config=config)
    assert (
        main(
            [
                "--workspace",
                str(ws),
                "--venv",
                str(make_venv(tmp_path)),
                "--user",
                "skilltrain",
                "--print",
            ]
        )
        == ExitCode.OK
    )
    captured = capsys.readouterr()
    unit = captured.out
    assert setting(unit, "ReadWritePaths") == [f'"{elsewhere}/runs" "{elsewhere}/logs"']
    assert setting(unit, "ReadOnlyPaths") == [f'"-{ws}/corpus" "-{ws}/prompts"']
    assert "does not exist" in captured.err  # runs/ is not there yet


def test_main_refuses_a_bad_config(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path, config="[daemon]\nshutdown_timeout = 5\n")
    with pytest.raises(ConfigError, match="unknown key"):
        main(["--workspace", str(ws), "--venv", str(make_venv(tmp_path)), "--print"])


def test_main_needs_the_venv_executable(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path, config="")
    with pytest.raises(ConfigError, match="bin/skilltrain not found"):
        main(["--workspace", str(ws), "--venv", str(tmp_path / "none"), "--print"])


def test_main_default_user_is_the_workspace_owner_never_root(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path, config="")
    args = ["--workspace", str(ws), "--venv", str(make_venv(tmp_path)), "--print"]
    if ws.stat().st_uid == 0:
        with pytest.raises(ConfigError, match="belongs to root"):
            main(args)
    else:
        assert main(args) == ExitCode.OK


def test_logrotate_rules(tmp_path: Path) -> None:
    log = tmp_path / "my runs" / "skilltrain.jsonl"
    rules = render_logrotate(log_file=log, user="skilltrain", group="skilltrain")
    assert f'"{log}" {{' in rules
    assert "su skilltrain skilltrain" in rules
    assert "create 0640 skilltrain skilltrain" in rules
    assert "delaycompress" in rules
    # WatchedFileHandler reopens after the rename; copytruncate would lose lines.
    assert not [line for line in rules.splitlines() if line.strip().startswith("copytruncate")]
    with pytest.raises(ConfigError, match="glob"):
        render_logrotate(log_file=tmp_path / "r[1]" / "x.jsonl", user="u", group="g")


def test_template_is_found_from_the_package() -> None:
    assert unit_render.UNIT_TEMPLATE.is_file()
    assert unit_render.LOGROTATE_TEMPLATE.is_file()


def test_main_writes_logrotate_rules_for_the_configured_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = make_workspace(tmp_path, config='[log]\nfile = "runs/daemon.jsonl"\n')
    rules_file = tmp_path / "logrotate.d" / "skilltrain"
    code = main(
        [
            "--workspace",
            str(ws),
            "--venv",
            str(make_venv(tmp_path)),
            "--user",
            "skilltrain",
            "--group",
            "skilltrain",
            "--print",
            "--logrotate-output",
            str(rules_file),
        ]
    )
    assert code == ExitCode.OK
    assert f'"{ws}/runs/daemon.jsonl" {{' in rules_file.read_text()
    captured = capsys.readouterr()
    assert f"wrote {rules_file}" in captured.err  # stdout stays the unit alone
    assert "wrote" not in captured.out


def test_dev_shm_is_private_and_ipc_is_not_shared_with_the_host(tmp_path: Path) -> None:
    # PrivateDevices= alone binds the host's writable /dev/shm into the unit.
    unit = render(tmp_path)
    (value,) = setting(unit, "TemporaryFileSystem")
    path, _, options = value.partition(":")
    assert path == "/dev/shm"
    assert {"nosuid", "nodev", "noexec"} <= set(options.split(","))
    assert setting(unit, "PrivateIPC") == ["yes"]


def test_the_private_dev_shm_is_usable_by_the_service_user(tmp_path: Path) -> None:
    # A tmpfs is root's 0755 unless told otherwise: shm_open, and with it
    # multiprocessing.Lock/Queue, would fail with EACCES for User=.
    unit = render(tmp_path)
    (value,) = setting(unit, "TemporaryFileSystem")
    options = dict(o.partition("=")[::2] for o in value.partition(":")[2].split(","))
    mode = int(options.get("mode", "755"), 8)
    assert mode & 0o777 == 0o777, oct(mode)  # any user of the service creates segments
    assert mode & stat.S_ISVTX, oct(mode)  # and deletes only its own


# --- several trainings on one host ------------------------------------------------------------


def install_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ws: Path, *args: str
) -> tuple[Path, Path]:
    """install-service with its default paths moved under tmp_path: (unit dir, logrotate dir)."""
    from skilltrain.daemon.commands import service_unit

    units, rotate = tmp_path / "etc" / "systemd" / "system", tmp_path / "etc" / "logrotate.d"
    monkeypatch.setattr(service_unit, "SYSTEM_UNIT_DIR", units)
    monkeypatch.setattr(service_unit, "LOGROTATE_DIR", rotate)
    venv = tmp_path / "venv" if (tmp_path / "venv").is_dir() else make_venv(tmp_path)
    code = main(["--workspace", str(ws), "--venv", str(venv), "--user", "skilltrain",
                 "--group", "skilltrain", "--logrotate", *args])
    assert code == ExitCode.OK
    return units, rotate


def test_two_instances_get_their_own_unit_state_and_logrotate_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    a = make_workspace(tmp_path, "a", config='[daemon]\ninstance = "gpu0"\n')
    b = make_workspace(tmp_path, "b", config="")
    units, rotate = install_instance(tmp_path, monkeypatch, a)  # named by its config.toml
    install_instance(tmp_path, monkeypatch, b, "--name", "gpu1")  # named on the command line
    printed = capsys.readouterr()

    assert sorted(p.name for p in units.iterdir()) == [
        "skilltrain-gpu0.service", "skilltrain-gpu1.service"]
    assert sorted(p.name for p in rotate.iterdir()) == ["skilltrain-gpu0", "skilltrain-gpu1"]
    for name, ws in (("gpu0", a), ("gpu1", b)):
        unit = (units / f"skilltrain-{name}.service").read_text()
        assert setting(unit, "StateDirectory") == [f"skilltrain-{name}"]
        assert setting(unit, "Environment")[-1] == (
            f"SKILLTRAIN_STATE=%S/skilltrain-{name}/state.sqlite3")
        assert f"--config \"{ws}/config.toml\"" in setting(unit, "ExecStart")[0]
        assert f'"{ws}/runs/skilltrain.jsonl" {{' in (rotate / f"skilltrain-{name}").read_text()
        assert f"systemctl enable --now skilltrain-{name}" in printed.out
        assert f"SKILLTRAIN_STATE=/var/lib/skilltrain-{name}/state.sqlite3 skilltrain status" \
            in printed.out
    # --name without [daemon] instance: status and tail could not say it.
    assert 'add `instance = "gpu1"` under [daemon]' in printed.err


def test_a_name_that_disagrees_with_the_config_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = make_workspace(tmp_path, config='[daemon]\ninstance = "gpu0"\n')
    with pytest.raises(ConfigError, match="use one name"):
        install_instance(tmp_path, monkeypatch, ws, "--name", "gpu1")
    with pytest.raises(ConfigError, match="--name 'a b'"):
        install_instance(tmp_path, monkeypatch, ws, "--name", "a b")
    assert not (tmp_path / "etc").exists()


@needs_analyze
def test_an_instance_unit_verifies_and_scores_at_most_2(tmp_path: Path) -> None:
    unit_file = tmp_path / "skilltrain-gpu0.service"
    unit_file.write_text(render(tmp_path, instance="gpu0"))
    done = verify(unit_file)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
    report = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--threshold=20", str(unit_file)],
        capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stdout + report.stderr
