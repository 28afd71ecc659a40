"""Several trainings on one host: `[daemon] instance` names the service, and
`status` and `tail` say which instance (and which config and state) they read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skilltrain.daemon.core import config
from skilltrain.daemon.core.errors import ConfigError
from tests.daemon_helpers import run_cli


def workspace(root: Path, name: str, daemon: str) -> Path:
    ws = root / name
    for sub in ("runs", "data", "prompts"):
        (ws / sub).mkdir(parents=True)
    (ws / "runs" / "skilltrain.jsonl").write_text("")
    path = ws / "config.toml"
    path.write_text(f"[daemon]\n{daemon}\n")
    return path


@pytest.mark.parametrize(("daemon", "said"), [
    ('instance = "gpu0"', "instance gpu0 (skilltrain-gpu0.service, {config})"),
    ("", "instance (unnamed) (skilltrain.service, {config})"),
])
def test_status_and_tail_say_which_instance_they_read(
    tmp_path: Path, daemon: str, said: str
) -> None:
    cfg = workspace(tmp_path, "a", daemon)
    workspace(tmp_path, "b", 'instance = "other"')  # another training beside it
    said = said.format(config=cfg)

    text, _ = run_cli("status", "--config", str(cfg))
    assert text.returncode == 0, text.stderr
    second = text.stdout.splitlines()[1]  # under the daemon's line
    assert second == f"{said}; state {tmp_path}/a/runs/.skilltrain/state.sqlite3"
    as_json, _ = run_cli("status", "--json", "--config", str(cfg))
    instance = json.loads(as_json.stdout)["instance"]
    assert instance["name"] == (None if not daemon else "gpu0")
    assert instance["config"] == str(cfg)

    tail, _ = run_cli("tail", "--config", str(cfg))
    assert tail.returncode == 0, tail.stderr
    assert f"skilltrain tail: {said}, log {tmp_path}/a/runs/skilltrain.jsonl" in tail.stderr
    assert tail.stdout == ""  # stdout stays the events


@pytest.mark.parametrize("name", ["", "-x", "a b", "a/b", "a@b", "x" * 65])
def test_an_instance_name_the_unit_cannot_carry_is_a_config_error(
    tmp_path: Path, name: str
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"[daemon]\ninstance = {json.dumps(name)}\n")
    with pytest.raises(ConfigError, match="instance"):
        config.load(path)
