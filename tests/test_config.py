"""config.toml: defaults, one-line errors for every kind of mistake, environment
overrides, paths resolved against the file's folder, and the CLI's exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from skilltrain.daemon.core import config
from skilltrain.daemon.core.config import BUILTIN_MODEL, Config
from skilltrain.daemon.core.errors import ConfigError, ExitCode

REPO = Path(__file__).resolve().parent.parent
SKILLTRAIN = REPO / ".venv" / "bin" / "skilltrain"


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def load_error(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        config.load(path, environ=environ or {})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    return message[len(f"{path}: ") :]


# --------------------------------------------------------------------------- defaults


def test_no_config_file_means_the_defaults_resolved_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)

    cfg = config.load(None, environ={})

    assert cfg.llm.model == BUILTIN_MODEL
    assert cfg.llm.api_base is None
    assert cfg.llm.timeout_s == 600.0
    assert cfg.llm.max_retries == 4
    assert cfg.loss.episodes_per_report == 3
    assert cfg.watch.observer == "auto"
    assert cfg.integrity.on_leak == "redact"
    assert cfg.optimizer.command == []
    assert cfg.paths.data == tmp_path / "data"
    assert cfg.paths.runs == tmp_path / "runs"
    assert cfg.paths.prompts == tmp_path / "prompts"
    assert cfg.log.file == tmp_path / "runs" / "skilltrain.jsonl"
    assert cfg.source is None  # defaults only: no file was read


def test_the_shipped_config_toml_is_valid_and_states_the_defaults() -> None:
    cfg = config.load(REPO / "config.toml", environ={})

    defaults = Config()
    for section in ("llm", "loss", "watch", "optimizer", "writer", "integrity", "daemon"):
        assert getattr(cfg, section) == getattr(defaults, section), section
    assert cfg.log.level == defaults.log.level
    assert cfg.loop is None  # commented out: no run advances on its own unless asked
    assert cfg.paths.prompts == REPO / "prompts"
    assert (cfg.paths.prompts / "loss.md.j2").is_file()


def test_config_is_frozen(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, ""), environ={})

    with pytest.raises(ValueError, match="frozen"):
        cfg.llm.timeout_s = 1.0


def test_values_from_the_file_are_used(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[llm]\nmodel = "openai/gpt-4o-mini"\ntimeout_s = 30\nmax_retries = 0\n'
        '[watch]\nobserver = "polling"\n'
        '[optimizer]\ncommand = ["python", "-m", "opt", "--run", "{run_dir}"]\n',
    )

    cfg = config.load(path, environ={})

    assert cfg.llm.model == "openai/gpt-4o-mini"
    assert cfg.llm.timeout_s == 30.0 and isinstance(cfg.llm.timeout_s, float)
    assert cfg.llm.max_retries == 0
    assert cfg.watch.observer == "polling"
    assert cfg.optimizer.command == ["python", "-m", "opt", "--run", "{run_dir}"]


# --------------------------------------------------------------------------- one-line errors


def test_unknown_key_suggests_the_close_one_and_lists_the_allowed(tmp_path: Path) -> None:
    message = load_error(tmp_path, '[llm]\nmodell = "openai/gpt-4o-mini"\n')

    assert message.startswith("unknown key [llm] modell (did you mean 'model'?); allowed: ")
    allowed = message.split("allowed: ")[1].split(", ")
    assert allowed == list(config.LLMConfig.model_fields)


def test_unknown_section_suggests_the_close_one(tmp_path: Path) -> None:
    message = load_error(tmp_path, '[llms]\nmodel = "x"\n')

    assert message == (
        "unknown key llms (did you mean 'llm'?); "
        "allowed: paths, llm, loss, watch, optimizer, writer, loop, log, integrity, daemon, "
        "metrics"
    )


def test_unknown_key_without_a_close_one_has_no_suggestion(tmp_path: Path) -> None:
    message = load_error(tmp_path, "[loss]\nzzz = 1\n")

    assert message.startswith("unknown key [loss] zzz; allowed: episodes_per_report, ")


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('[llm]\ntimeout = "fast"\n', "[llm] timeout = 'fast': Input should be a valid number"),
        ("[llm]\nmax_retries = true\n", "[llm] max_retries = True: Input should be a valid int"),
        ("[llm]\nmax_retries = 2.0\n", "[llm] max_retries = 2.0: Input should be a valid integer"),
        ('[llm]\nmodel = ""\n', "[llm] model = '': String should have at least 1 character"),
        (
            '[optimizer]\ncommand = "python opt.py"\n',
            "[optimizer] command = 'python opt.py': Input should be a valid list",
        ),
        (
            '[optimizer]\ncommand = ["python", 3]\n',
            "[optimizer] command.1 = 3: Input should be a valid string",
        ),
        ("[paths]\ndata = 5\n", "[paths] data = 5: Input is not a valid path"),
    ],
    ids=[
        "str-for-float",
        "bool-for-int",
        "float-for-int",
        "empty-model",
        "str-for-list",
        "list-item",
        "int-for-path",
    ],
)
def test_wrong_type_names_key_value_and_expected_type(
    tmp_path: Path, toml: str, expected: str
) -> None:
    assert load_error(tmp_path, toml).startswith(expected)


@pytest.mark.parametrize(
    ("section", "key", "value", "bound"),
    [
        ("llm", "max_retries", "99", "less than or equal to 20"),
        ("llm", "timeout_s", "0", "greater than 0"),
        ("llm", "temperature", "3.5", "less than or equal to 2"),
        ("loss", "concurrency", "0", "greater than or equal to 1"),
        ("loss", "settle_s", "-1", "greater than or equal to 0"),
    ],
)
def test_out_of_range_names_key_value_and_bound(
    tmp_path: Path, section: str, key: str, value: str, bound: str
) -> None:
    message = load_error(tmp_path, f"[{section}]\n{key} = {value}\n")

    assert message == f"[{section}] {key} = {value}: Input should be {bound}"


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        (
            '[watch]\nobserver = "inotify"\n',
            "[watch] observer = 'inotify': Input should be 'auto', 'native' or 'polling'",
        ),
        (
            '[log]\nlevel = "verbose"\n',
            "[log] level = 'verbose': Input should be 'debug', 'info', 'warning' or 'error'",
        ),
        (
            '[integrity]\non_leak = "ignore"\n',
            "[integrity] on_leak = 'ignore': Input should be 'redact' or 'refuse'",
        ),
        (
            '[daemon]\ncpu = "two"\n',
            "[daemon] cpu = 'two': Input should be 'one' or 'any', or Input should be a valid "
            "integer",
        ),
        (
            "[daemon]\ncpu = true\n",  # not CPU 1
            "[daemon] cpu = True: Input should be 'one' or 'any', or Input should be a valid "
            "integer",
        ),
    ],
    ids=["observer", "log-level", "on-leak", "cpu-word", "cpu-bool"],
)
def test_bad_choice_lists_the_allowed_values(tmp_path: Path, toml: str, expected: str) -> None:
    assert load_error(tmp_path, toml) == expected


def test_invalid_toml_is_one_line_with_the_position(tmp_path: Path) -> None:
    message = load_error(tmp_path, '[llm\nmodel = "x"\n')

    assert message.startswith("not valid TOML: ")
    assert "line 1" in message


def test_config_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b'[llm]\nmodel = "caf\xe9"\n')

    with pytest.raises(ConfigError, match=r"config\.toml: cannot read: ") as caught:
        config.load(path, environ={})
    assert "\n" not in str(caught.value)


def test_explicit_config_path_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "config.toml"

    with pytest.raises(ConfigError, match=r"config\.toml: config file not found$"):
        config.load(missing, environ={})


def test_llm_that_is_not_a_table_is_a_one_line_config_error(tmp_path: Path) -> None:
    message = load_error(tmp_path, 'llm = "openai/gpt-4o-mini"\n')

    assert message.startswith("llm = 'openai/gpt-4o-mini': ")


def test_other_section_that_is_not_a_table_is_a_one_line_config_error(tmp_path: Path) -> None:
    message = load_error(tmp_path, "loss = 3\n")

    assert message.startswith("loss = 3: ")


# --------------------------------------------------------------------------- environment


def test_environment_overrides_model_api_base_and_timeout(tmp_path: Path) -> None:
    path = write(tmp_path, '[llm]\nmodel = "builtin/craft-metrics"\ntimeout_s = 600\n')
    environ = {
        "SKILLTRAIN_LLM_MODEL": "openai/gpt-4o-mini",
        "SKILLTRAIN_LLM_API_BASE": "http://127.0.0.1:8000/v1",
        "SKILLTRAIN_LLM_TIMEOUT_S": "30",
        "SKILLTRAIN_LLM_MAX_RETRIES": "0",
        "SKILLTRAIN_LLM_TEMPERATURE": "0.2",
        "SKILLTRAIN_OTHER": "ignored",
        "OPENAI_API_KEY": "sk-not-config",
    }

    cfg = config.load(path, environ=environ)

    assert cfg.llm.model == "openai/gpt-4o-mini"
    assert cfg.llm.api_base == "http://127.0.0.1:8000/v1"
    assert cfg.llm.timeout_s == 30.0
    assert cfg.llm.max_retries == 0
    assert cfg.llm.temperature == 0.2
    assert cfg.renamed == ()


def test_environment_override_applies_without_a_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)

    cfg = config.load(None, environ={"SKILLTRAIN_LLM_MODEL": "anthropic/claude-sonnet-4-5"})

    assert cfg.llm.model == "anthropic/claude-sonnet-4-5"
    assert cfg.llm.timeout_s == 600.0


def test_load_reads_os_environ_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKILLTRAIN_LLM_TIMEOUT", "12.5")

    assert config.load(write(tmp_path, "")).llm.timeout_s == 12.5


def test_bad_environment_override_is_validated_like_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "")

    origin = r"\(from the environment variable SKILLTRAIN_LLM_TIMEOUT\)"
    with pytest.raises(ConfigError, match=rf"\[llm\] timeout = -1 {origin}: Input should be great"):
        config.load(path, environ={"SKILLTRAIN_LLM_TIMEOUT": "-1"})
    with pytest.raises(ConfigError, match=rf"\[llm\] timeout = 'soon' {origin}: Input should be a"):
        config.load(path, environ={"SKILLTRAIN_LLM_TIMEOUT": "soon"})


def test_unknown_environment_override_never_echoes_its_value(tmp_path: Path) -> None:
    # Someone will try SKILLTRAIN_LLM_API_KEY; the refusal must not print the key.
    path = write(tmp_path, "")

    with pytest.raises(ConfigError) as caught:
        config.load(path, environ={"SKILLTRAIN_LLM_API_KEY": "sk-live-secret-0123456789"})

    message = str(caught.value)
    assert ("unknown key [llm] api_key (from the environment variable SKILLTRAIN_LLM_API_KEY)"
            " (did you mean 'api_base'?)") in message
    assert "sk-live" not in message


def test_bad_environment_override_names_the_variable(tmp_path: Path) -> None:
    path = write(tmp_path, "[llm]\ntimeout = 600\n")

    with pytest.raises(ConfigError, match="SKILLTRAIN_LLM_TIMEOUT"):
        config.load(path, environ={"SKILLTRAIN_LLM_TIMEOUT": "-1"})


# --------------------------------------------------------------------------- paths


def test_relative_paths_resolve_against_the_config_folder_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(
        tmp_path,
        '[paths]\ndata = "corpus"\nruns = "../shared/runs"\nprompts = "/abs/prompts"\n'
        '[log]\nfile = "logs/s.jsonl"\n',
        name="etc/skilltrain/config.toml",
    )
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    cfg = config.load(Path(os.path.relpath(path, elsewhere)), environ={})

    folder = tmp_path / "etc" / "skilltrain"
    assert cfg.paths.data == folder / "corpus"
    assert cfg.paths.runs == tmp_path / "etc" / "shared" / "runs"
    assert cfg.paths.prompts == Path("/abs/prompts")
    assert cfg.log.file == folder / "logs" / "s.jsonl"
    assert cfg.source == path
    assert all(p.is_absolute() for p in (cfg.paths.data, cfg.paths.runs, cfg.log.file))


# --------------------------------------------------------------------------- through the CLI


def _cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKILLTRAIN_")}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    return env


@pytest.mark.parametrize(
    ("toml", "fragment"),
    [
        ("[watch]\nobserver = 'inotify'\n", "[watch] observer = 'inotify'"),
        ("[llm]\nmodell = 'x'\n", "did you mean 'model'?"),
        ("[llm\n", "not valid TOML"),
    ],
    ids=["bad-value", "unknown-key", "bad-toml"],
)
def test_status_with_a_bad_config_exits_2_with_one_line(
    tmp_path: Path, toml: str, fragment: str
) -> None:
    path = write(tmp_path, toml, name="bad.toml")

    proc = subprocess.run(
        [str(SKILLTRAIN), "status", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        env=_cli_env(),
        cwd=tmp_path,
    )

    assert proc.returncode == ExitCode.CONFIG == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"skilltrain: {path}: ")
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr


def test_status_with_a_missing_explicit_config_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "skilltrain", "status", "--config", str(tmp_path / "no.toml")],
        capture_output=True,
        text=True,
        timeout=30,
        env=_cli_env(),
        cwd=tmp_path,
    )

    assert proc.returncode == 2
    assert proc.stderr == f"skilltrain: {tmp_path / 'no.toml'}: config file not found\n"


def test_status_with_a_bad_environment_override_exits_2(tmp_path: Path) -> None:
    env = _cli_env() | {"SKILLTRAIN_LLM_MAX_RETRIES": "many"}

    proc = subprocess.run(
        [str(SKILLTRAIN), "status"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd=tmp_path,
    )

    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "[llm] max_retries = 'many'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_state_follows_runs_unless_set_and_the_environment_wins(tmp_path: Path) -> None:
    moved = config.load(write(tmp_path, '[paths]\nruns = "/srv/runs"\n'), environ={})
    assert moved.paths.state == Path("/srv/runs/.skilltrain/state.sqlite3")
    own = config.load(write(tmp_path, '[paths]\nstate = "db/s.sqlite3"\n'), environ={})
    assert own.paths.state == tmp_path / "db" / "s.sqlite3"
    unit = config.load(write(tmp_path, '[paths]\nstate = "db/s.sqlite3"\n'),
                       environ={config.STATE_ENV: "/var/lib/skilltrain/state.sqlite3"})
    assert unit.paths.state == Path("/var/lib/skilltrain/state.sqlite3")


# ------------------------------------------------------------------ renamed keys


def test_the_old_duration_names_still_read_with_one_warning_naming_the_new(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, "[llm]\ntimeout = 30\n[loss]\nsettle_seconds = 2\n"
                           "[watch]\nresync_seconds = 60\n")

    cfg = config.load(path, environ={})

    assert (cfg.llm.timeout_s, cfg.loss.settle_s, cfg.watch.resync_s) == (30.0, 2.0, 60.0)
    assert len(cfg.renamed) == 3
    for old, new in (("[llm] timeout", "timeout_s"), ("[loss] settle_seconds", "settle_s"),
                     ("[watch] resync_seconds", "resync_s")):
        (note,) = [n for n in cfg.renamed if n.startswith(old + " ")]
        assert new in note and "still works" in note


def test_an_old_name_from_the_environment_wins_over_the_file_and_is_named(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, "[llm]\ntimeout_s = 600\n")

    cfg = config.load(path, environ={"SKILLTRAIN_LLM_TIMEOUT": "30"})

    assert cfg.llm.timeout_s == 30.0
    (note,) = cfg.renamed
    assert "SKILLTRAIN_LLM_TIMEOUT " in note and "SKILLTRAIN_LLM_TIMEOUT_S" in note
    bad = load_error(tmp_path, "[llm]\ntimeout_s = 600\n", {"SKILLTRAIN_LLM_TIMEOUT": "-1"})
    assert "SKILLTRAIN_LLM_TIMEOUT" in bad and "greater than 0" in bad


def test_an_old_and_a_new_name_of_one_setting_in_the_file_is_an_error(tmp_path: Path) -> None:
    message = load_error(tmp_path, "[loss]\nsettle_seconds = 2\nsettle_s = 3\n")
    assert message == "[loss] settle_seconds and settle_s are the same setting; keep settle_s"


def test_the_daemon_logs_each_old_name_once_at_start(tmp_path: Path) -> None:
    from tests.daemon_helpers import build_workspace, read_events, run_cli

    ws = build_workspace(tmp_path, "http://127.0.0.1:9/v1", works={"alpha": 3})
    text = ws.config_path.read_text(encoding="utf-8")
    ws.config_path.write_text(text.replace("settle_s =", "settle_seconds ="), encoding="utf-8")
    result, _ = run_cli("daemon", "--once", "--config", str(ws.config_path))
    assert result.returncode == 0, result.stderr
    warnings = [ln for ln in result.stderr.splitlines() if ln.startswith("skilltrain: warning")]
    assert warnings == ["skilltrain: warning: [loss] settle_seconds is now called [loss] "
                        "settle_s; the old name still works"]
    (logged,) = read_events(ws.log_file, "config.renamed")
    assert logged["level"] == "warning" and "settle_s" in logged["note"]
