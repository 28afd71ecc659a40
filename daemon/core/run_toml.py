"""runs/<run>/run.toml: a run's own settings, read in one place.

    works = ["example"]     the works the run is scored on (default: every work in data/)
    [llm]
    mode = "batch"          the run's [llm] mode (default: config.toml's)

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


@dataclass(frozen=True)
class RunToml:
    works: tuple[str, ...] | None = None  # None: every work
    llm_mode: str | None = None  # None: config.toml's
    problems: tuple[str, ...] = ()  # each says what is wrong and what applies instead


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
                                 "using all works and config.toml's [llm]",))
    problems: list[str] = []
    works = data.get("works")
    if works is not None and not (isinstance(works, list)
                                  and all(isinstance(n, str) for n in works)):
        problems.append("works must be a list of work names; using all works")
        works = None
    llm = data.get("llm", {})
    mode = llm.get("mode") if isinstance(llm, dict) else None
    if mode is not None and mode not in LLM_MODES:
        problems.append(f"[llm] mode = {mode!r} is not \"live\" or \"batch\"; "
                        "using config.toml's")
        mode = None
    return RunToml(tuple(works) if works is not None else None, mode, tuple(problems))
