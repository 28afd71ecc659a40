"""runs/<run>/run.toml: a run's own settings, read in one place.

    works = ["example"]     the works the run is scored on (default: every work in data/)
    [llm]
    mode = "batch"          the run's [llm] mode (default: config.toml's)
    service_tier = "flex"   the run's [llm] service_tier: "flex" or "standard" (default: config's)

One reading and one error handling for every key: an unreadable file or a
bad value is a problem (what, and that the default applies), which the
caller names once; the rest of the file still counts.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import layout

LLM_MODES = ("live", "batch")
SERVICE_TIERS = ("standard", "flex")


@dataclass(frozen=True)
class RunToml:
    works: tuple[str, ...] | None = None  # None: every work
    llm_mode: str | None = None  # None: config.toml's
    service_tier: str | None = None  # None: config.toml's
    problems: tuple[str, ...] = ()  # each says what is wrong and what applies instead
    unreadable: bool = False  # not TOML (being written, or broken): nothing in it counted


def path_of(runs: Path, run: str) -> Path:
    return runs / run / layout.RUN_TOML


def read(path: Path) -> RunToml:
    """A run's run.toml; no file is no setting (not a problem)."""
    try:
        data: Any = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return RunToml()
    except (OSError, ValueError) as e:
        return RunToml(problems=(f"unreadable run.toml ({type(e).__name__}); "
                                 "using all works and config.toml's [llm]",), unreadable=True)
    problems: list[str] = []
    works = data.get("works")
    if works is not None and not (isinstance(works, list)
                                  and all(isinstance(n, str) for n in works)):
        problems.append("works must be a list of work names; using all works")
        works = None
    llm = data.get("llm", {})
    mode = _choice(llm, "mode", LLM_MODES, problems)
    tier = _choice(llm, "service_tier", SERVICE_TIERS, problems)
    return RunToml(tuple(works) if works is not None else None, mode, tier, tuple(problems))


def _choice(llm: Any, key: str, allowed: tuple[str, ...], problems: list[str]) -> str | None:
    """[llm] <key> if it is one of `allowed`; a problem (config.toml's applies) if not."""
    value = llm.get(key) if isinstance(llm, dict) else None
    if value is not None and value not in allowed:
        choices = " or ".join(f'"{a}"' for a in allowed)
        problems.append(f"[llm] {key} = {value!r} is not {choices}; using config.toml's")
        return None
    return value
