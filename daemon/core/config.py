"""config.toml: one typed, frozen config object, validated once at start.

Validation is pydantic's (already a litellm dependency): strict types, unknown
keys rejected, and every error turned into one line that names the key, the
value and what is allowed. Relative paths are resolved against the directory
of the config file, so the daemon behaves the same whatever its working
directory is.
"""
from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from . import layout
from .errors import ConfigError

DEFAULT_CONFIG = Path("config.toml")
LLM_ENV_PREFIX = "SKILLTRAIN_LLM_"
# Overrides [paths] state: the systemd unit points it into StateDirectory=.
STATE_ENV = "SKILLTRAIN_STATE"
BUILTIN_MODEL = "builtin/craft-metrics"

TIMEOUT_S = 600.0  # [llm] timeout_s unset
FLEX_TIMEOUT_S = 900.0  # the same under flex: OpenAI's advice for flex (15 minutes)


def default_timeout_s(service_tier: object) -> float:
    return FLEX_TIMEOUT_S if service_tier == "flex" else TIMEOUT_S


# TOML has no path type: accept a string here, stay strict everywhere else.
PathValue = Annotated[Path, Strict(False)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class PathsConfig(_Section):
    data: PathValue = Path("data")
    runs: PathValue = Path("runs")
    prompts: PathValue = Path("prompts")
    # Unset: <runs>/.skilltrain/state.sqlite3, wherever [paths] runs points.
    state: PathValue = Path("runs/.skilltrain/state.sqlite3")


class LLMConfig(_Section):
    model: str = Field(BUILTIN_MODEL, min_length=1)
    api_base: str | None = None
    # "flex": OpenAI's flex processing (half price, slower, sometimes "resource
    # unavailable"; daemon/infra/llm_flex.py). Unset or "standard": not sent.
    # A run's run.toml [llm] service_tier overrides it for that run.
    service_tier: Literal["standard", "flex"] | None = None
    # Unset: 600 s, or 900 s under flex (OpenAI suggests 15 minutes for flex replies).
    timeout_s: float = Field(default_factory=lambda data: default_timeout_s(
        data.get("service_tier")), gt=0)
    max_retries: int = Field(4, ge=0, le=20)
    backoff_initial_s: float = Field(2.0, gt=0)
    backoff_max_s: float = Field(120.0, gt=0)
    max_output_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, le=2)
    budget_usd: float | None = Field(None, gt=0)
    # A key the provider refuses (quota, billing, auth): one small call this
    # often until it works again (daemon/infra/llm_limit.py).
    probe_refused_key_s: float = Field(180.0, gt=0)
    # "batch": the provider's batch API at its batch price (daemon/service/batch.py);
    # a run's run.toml [llm] mode overrides it for that run.
    mode: Literal["live", "batch"] = "live"
    # A step's ready sets wait at most this long for the rest before they go.
    batch_gather_s: float = Field(60.0, ge=0)
    # Polls start at batch_poll_s and grow by half each time, to batch_poll_max_s.
    batch_poll_s: float = Field(30.0, gt=0)
    batch_poll_max_s: float = Field(600.0, gt=0)
    # Where an item the batch failed goes: into the next batch, or a live call.
    batch_failed: Literal["batch", "live"] = "batch"
    # A flex call refused for "resource unavailable" waits this long, then is
    # sent at the standard tier ("standard") or asks flex again ("wait").
    flex_unavailable_wait_s: float = Field(60.0, ge=0)
    flex_fallback: Literal["standard", "wait"] = "standard"

    @property
    def flex(self) -> bool:
        return self.service_tier == "flex"

    def with_tier(self, tier: str | None) -> LLMConfig:
        """These settings at another service tier (a run's run.toml, a flex fallback):
        the timeout follows the tier unless [llm] timeout_s was set."""
        tier = "flex" if tier == "flex" else None
        if (tier == "flex") == self.flex:
            return self
        update: dict[str, Any] = {"service_tier": tier}
        if "timeout_s" not in self.model_fields_set:
            update["timeout_s"] = default_timeout_s(tier)
        copy = self.model_copy(update=update)
        # Still "not set": a later change of tier moves the timeout again.
        copy.__pydantic_fields_set__.discard("timeout_s")
        return copy


class LossConfig(_Section):
    episodes_per_report: int = Field(3, ge=1)
    settle_s: float = Field(30.0, ge=0)
    # A number: that many calls at once, fixed (each backs off on its own).
    # "adaptive": per endpoint, between the two bounds below (daemon/llm_limit.py).
    concurrency: Annotated[int, Field(ge=1, le=1024)] | Literal["adaptive"] = "adaptive"
    concurrency_min_calls: int = Field(1, ge=1, le=1024)
    concurrency_max_calls: int = Field(64, ge=1, le=1024)
    max_attempts: int = Field(5, ge=1)
    retry_backoff_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _bounds_in_order(self) -> LossConfig:
        if self.concurrency_min_calls > self.concurrency_max_calls:
            raise ValueError(f"concurrency_min_calls ({self.concurrency_min_calls}) is above "
                             f"concurrency_max_calls ({self.concurrency_max_calls})")
        return self

    @property
    def fixed_concurrency(self) -> int | None:
        """The fixed number of calls at once, or None when adaptive."""
        return self.concurrency if isinstance(self.concurrency, int) else None


class WatchConfig(_Section):
    resync_s: float = Field(300.0, gt=0)
    observer: Literal["auto", "native", "polling"] = "auto"


class OptimizerConfig(_Section):
    command: list[str] = Field(default_factory=list)
    timeout_s: float = Field(3600.0, gt=0)
    max_attempts: int = Field(3, ge=1)
    # Unset: [loss] retry_backoff_s, as before this key existed.
    retry_backoff_s: float | None = Field(None, ge=0)
    # The command submits a job that runs on after the daemon dies (sbatch --wait):
    # a restarted daemon waits for it instead of submitting again (handlers/detached.py).
    outlives_daemon: bool = False


class WriterConfig(_Section):
    # The closed-book writer of the loop (daemon/service/loop.py); argv, no shell.
    command: list[str] = Field(default_factory=list)
    timeout_s: float = Field(7200.0, gt=0)
    max_attempts: int = Field(3, ge=1)
    retry_backoff_s: float = Field(30.0, ge=0)
    outlives_daemon: bool = False  # as [optimizer] outlives_daemon


class LoopConfig(_Section):
    # Present in config.toml: runs advance on their own (writer -> loss -> optimizer).
    steps_per_epoch: int = Field(10, ge=1)
    max_epochs: int = Field(3, ge=1)
    stop_below: float | None = Field(None, ge=0)
    patience: int | None = Field(None, ge=1)


class LogConfig(_Section):
    file: PathValue | None = Path("runs/skilltrain.jsonl")
    level: Literal["debug", "info", "warning", "error"] = "info"


class IntegrityConfig(_Section):
    on_leak: Literal["redact", "refuse"] = "redact"
    audit_on_start: bool = True
    # A report whose claims the craft statistics contradict (docs/grounded-reports.md).
    on_contradiction: Literal["annotate", "refuse", "ignore"] = "annotate"
    refuse_share: float = Field(0.5, ge=0, le=1)


INSTANCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class DaemonConfig(_Section):
    shutdown_timeout_s: float = Field(60.0, ge=0)
    # Several trainings on one host: the name of this workspace's service
    # (unit skilltrain-NAME.service, its state dir and logrotate file);
    # `install-service` takes it from here, `status` and `tail` say it.
    instance: str | None = None
    # Where the daemon's threads run (daemon/infra/cpu.py): "one" CPU, the one
    # it starts on (they take turns on the GIL; on one core a turn costs less),
    # a CPU by number, or "any" (the kernel spreads them). Children are not pinned.
    cpu: Literal["one", "any"] | Annotated[int, Field(ge=0)] = "one"

    @field_validator("instance")
    @classmethod
    def _instance_name(cls, value: str | None) -> str | None:
        if value is not None and not INSTANCE_NAME.fullmatch(value):
            raise ValueError("an instance name is 1-64 letters, digits, '.', '_', '-', "
                             "starting with a letter or digit")
        return value


def unit_name(instance: str | None) -> str:
    """The systemd unit (without .service) that runs this instance."""
    return "skilltrain" if instance is None else f"skilltrain-{instance}"


def describe_instance(cfg: Config) -> str:
    """Which training `status` and `tail` read: "instance gpu0 (skilltrain-gpu0.service,
    /srv/a/config.toml)"."""
    name = cfg.daemon.instance or "(unnamed)"
    source = cfg.source if cfg.source is not None else "no config file: the defaults"
    return f"instance {name} ({unit_name(cfg.daemon.instance)}.service, {source})"


class MetricsConfig(_Section):
    # "host:port" ("127.0.0.1:9464", "[::1]:9464"); unset: no metrics endpoint.
    listen: str | None = None

    @field_validator("listen")
    @classmethod
    def _host_and_port(cls, value: str | None) -> str | None:
        if value is not None:
            split_listen(value)
        return value


def split_listen(value: str) -> tuple[str, int]:
    """("127.0.0.1", 9464) from "127.0.0.1:9464"; ValueError says what is wrong."""
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("must be host:port with a port from 1 to 65535, "
                         "like \"127.0.0.1:9464\" or \"[::1]:9464\"")
    return host, int(port)


class Config(_Section):
    paths: PathsConfig = PathsConfig()
    llm: LLMConfig = LLMConfig()
    loss: LossConfig = LossConfig()
    watch: WatchConfig = WatchConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    writer: WriterConfig = WriterConfig()
    loop: LoopConfig | None = None
    log: LogConfig = LogConfig()
    integrity: IntegrityConfig = IntegrityConfig()
    daemon: DaemonConfig = DaemonConfig()
    metrics: MetricsConfig = MetricsConfig()

    _source: Path | None = PrivateAttr(default=None)
    _renamed: tuple[str, ...] = PrivateAttr(default=())

    @property
    def source(self) -> Path | None:
        """The config file this was loaded from (None: defaults only)."""
        return self._source

    @property
    def renamed(self) -> tuple[str, ...]:
        """One line per old key name this config still uses (its new name in it)."""
        return self._renamed


def load(path: Path | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Read, override from the environment, validate and resolve paths.

    `path=None` means the default ./config.toml, which may be absent (then the
    defaults apply); a path given explicitly must exist.
    """
    environ = os.environ if environ is None else environ
    explicit = path is not None
    path = DEFAULT_CONFIG if path is None else path
    raw: dict[str, Any] = {}
    if path.exists():
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    elif explicit:
        raise ConfigError(f"{path}: config file not found")
    raw, from_env = _apply_env_overrides(raw, environ)
    raw, renamed, written_as = _rename_old_keys(raw, path, from_env)
    try:
        config = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{path}: {_describe(e, from_env, written_as)}") from None
    config = _resolve_paths(config, path.resolve().parent,
                            source=path.resolve() if path.exists() else None,
                            state=environ.get(STATE_ENV) or None)
    config._renamed = renamed
    return config


# Durations are named with one unit suffix, `_s`. The names before that still
# read, with one warning each (Config.renamed; the daemon logs it at start).
RENAMED = {("llm", "timeout"): "timeout_s", ("loss", "settle_seconds"): "settle_s",
           ("watch", "resync_seconds"): "resync_s"}


def _rename_old_keys(raw: dict[str, Any], path: Path, from_env: dict[str, str]
                     ) -> tuple[dict[str, Any], tuple[str, ...], dict[tuple[str, str], str]]:
    """The raw config with old names moved to the new ones, a note per old
    name, and the name each moved key was written as (for error messages)."""
    notes = []
    written_as: dict[tuple[str, str], str] = {}
    for (section, old), new in RENAMED.items():
        table = raw.get(section)
        if not isinstance(table, dict) or old not in table:
            continue
        origin = from_env.pop(old, None) if section == "llm" else None
        where = f"the environment variable {origin}" if origin else f"[{section}] {old}"
        if new in table and not origin:  # the environment wins over the file
            raise ConfigError(f"{path}: [{section}] {old} and {new} are the same setting; "
                              f"keep {new}")
        table = {k: v for k, v in table.items() if k != old} | {new: table[old]}
        raw = {**raw, section: table}
        written_as[(section, new)] = old
        if origin:
            from_env[new] = origin
        notes.append(f"{where} is now called {new} ([{section}] {new}, or "
                     f"{LLM_ENV_PREFIX}{new.upper()}); the old name still works"
                     if section == "llm" else
                     f"{where} is now called [{section}] {new}; the old name still works")
    return raw, tuple(notes), written_as


def defaults_notice(config: Config) -> str | None:
    """What was assumed when no config file was found (None when one was)."""
    if config.source is not None:
        return None
    paths = config.paths
    return (f"no {DEFAULT_CONFIG} in {Path.cwd()} (and no --config): assuming the defaults, "
            f"data={paths.data} runs={paths.runs} prompts={paths.prompts}")


def with_llm_overrides(llm: LLMConfig, overrides: Mapping[str, object],
                       origin: str) -> LLMConfig:
    """[llm] with some keys replaced, validated like the file (flags of `skilltrain loss`)."""
    try:
        return LLMConfig.model_validate({**llm.model_dump(), **overrides})
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"{origin}: {key} = {first.get('input')!r}: {first['msg']}") from None


def _apply_env_overrides(raw: dict[str, Any], environ: Mapping[str, str]
                         ) -> tuple[dict[str, Any], dict[str, str]]:
    """SKILLTRAIN_LLM_<KEY>=value overrides [llm] <key>.

    The value is read as a TOML literal when it is one (`30`, `true`), else
    as a plain string (`openai/gpt-4o-mini`, `http://127.0.0.1:8000/v1`), so
    numbers and strings both work without quoting. Returns the new raw
    config and which [llm] keys came from which variable.
    """
    section = raw.get("llm", {})
    if not isinstance(section, dict):
        return raw, {}  # `llm = "x"`: pydantic says it must be a table
    llm = dict(section)
    from_env: dict[str, str] = {}
    for name, value in environ.items():
        if not name.startswith(LLM_ENV_PREFIX):
            continue
        key = name[len(LLM_ENV_PREFIX):].lower()
        from_env[key] = name
        try:
            llm[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            llm[key] = value
    if llm:
        raw = {**raw, "llm": llm}
    return raw, from_env


def _describe(error: ValidationError, from_env: Mapping[str, str],
              written_as: Mapping[tuple[str, str], str] | None = None) -> str:
    """The first validation error as one line: key, value, what is allowed
    (a key under the name it was written as)."""
    errors = error.errors()
    first = errors[0]
    loc = _key_path(first["loc"])
    # A key that may be one of two types ([loss] concurrency: a number or
    # "adaptive") fails once per type: a value of the right type but out of
    # range says the range; a value of neither type says what each accepts.
    same_key = [e for e in errors if _key_path(e["loc"]) == loc]
    in_type = [e for e in same_key if not str(e["type"]).endswith(_WRONG_TYPE)]
    msg = ", or ".join(dict.fromkeys(str(e["msg"]) for e in (in_type[:1] or same_key)))
    if len(loc) == 2 and (old := (written_as or {}).get((loc[0], loc[1]))):
        if loc[1] in from_env:
            from_env = {**from_env, old: from_env[loc[1]]}
        loc[1] = old
    key = f"[{loc[0]}] {'.'.join(loc[1:])}" if len(loc) > 1 else loc[0]
    if first["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        hint = difflib.get_close_matches(loc[-1], allowed, n=1)
        did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
        if len(loc) == 2 and loc[0] == "llm" and loc[1] in from_env:
            key = f"{key} (from the environment variable {from_env[loc[1]]})"
        return f"unknown key {key}{did_you_mean}; allowed: {', '.join(allowed)}"
    value = first.get("input")
    origin = ""
    if len(loc) == 2 and loc[0] == "llm" and loc[1] in from_env:
        origin = f" (from the environment variable {from_env[loc[1]]})"
    return f"{key} = {value!r}{origin}: {msg}"


_WRONG_TYPE = ("_type", "_parsing", "literal_error")
_UNION_MEMBER = re.compile(r"constrained-\w+|literal\[.*\]|int|str|float|bool")


def _key_path(loc: tuple[int | str, ...]) -> list[str]:
    """The error's location as config keys, without pydantic's union-member tags."""
    return [str(p) for p in loc if not _UNION_MEMBER.fullmatch(str(p))]


def _allowed_keys(section: list[str]) -> list[str]:
    model: type[BaseModel] = Config
    for part in section:
        annotation = model.model_fields[part].annotation
        # An optional section ([loop]) is `Section | None`: its keys are the Section's.
        annotation = next((a for a in get_args(annotation) if a is not type(None)), annotation)
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation
    return list(model.model_fields)


def _resolve_paths(config: Config, base: Path, source: Path | None,
                   state: str | None = None) -> Config:
    def resolve(p: Path) -> Path:
        return p if p.is_absolute() else (base / p).resolve()

    runs = resolve(config.paths.runs)
    if state is None and "state" not in config.paths.model_fields_set:
        state_path = layout.default_state_path(runs)
    else:
        state_path = resolve(Path(state) if state is not None else config.paths.state)
    paths = PathsConfig(
        data=resolve(config.paths.data),
        runs=runs,
        prompts=resolve(config.paths.prompts),
        state=state_path,
    )
    log_file = None if config.log.file is None else resolve(config.log.file)
    log = config.log.model_copy(update={"file": log_file})
    resolved = config.model_copy(update={"paths": paths, "log": log})
    resolved._source = source
    return resolved
