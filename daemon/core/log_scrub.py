"""Credentials out of log lines: API keys scrubbed from every field and from
exception text, by their shape and by value (the keys configured in the
environment), before a line is rendered. See log.py for the whole chain.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from structlog.typing import EventDict, WrappedLogger

from .short_memo import NO_TEXT_TYPES, STAMP_FIELD, ShortStringMemo, is_stamp

REDACTED = "[redacted]"

# Field names whose value is a credential whatever it looks like. Anchored at the
# end so `tokens_in` / `prompt_tokens` (counts, not credentials) stay visible.
_SECRET_FIELD = re.compile(
    r"(?:^|_)(?:api_?key|apikey|token|secret|password|passwd|authorization|auth"
    r"|credentials?|private_key|access_key|secret_key|cookie)$"
)

# Strings that look like credentials wherever they appear (messages, exception text).
_SECRET_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_\-]{10,}"), REDACTED),
    (re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=\-]{8,}", re.I), r"\1 " + REDACTED),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{30,}"), REDACTED),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}"), REDACTED),
    (re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*"), REDACTED),
    # key=..., "api_key": "...", x-api-key: ..., ?token=...: a long opaque value.
    (
        re.compile(
            r"(?i)\b([\w-]*(?:key|token|secret|password|passwd))"
            r"([\"']?\s*[=:]\s*[\"']?)([A-Za-z0-9+/_\-.~]{12,}={0,2})"
        ),
        r"\1\2" + REDACTED,
    ),
)

# All of _SECRET_PATTERNS in one search: most strings (names, paths, counts)
# match none, and one search costs a seventh of the seven substitutions.
_ANY_SECRET_SHAPE = re.compile("|".join(
    f"(?{'i' if p.flags & re.I else ''}:{p.pattern.removeprefix('(?i)')})"
    if p.flags & re.I else f"(?:{p.pattern})"
    for p, _ in _SECRET_PATTERNS))

# The configured keys, scrubbed by value: a provider's key may have no telltale shape.
_SECRET_ENV_SUFFIXES = ("_API_KEY", "_TOKEN", "_SECRET", "_PASSWORD", "_ACCESS_KEY")
_MIN_ENV_SECRET = 8  # shorter values ("1", "true") would shred ordinary text


_env_secrets_cache: tuple[float, int, list[str]] = (-1.0, -1, [])
_ENV_SECRETS_TTL_S = 1.0


def _env_secrets() -> list[str]:
    # Re-read when a variable was added or removed, and at least every second:
    # a key set after configure() (tests, a late env file) is still covered,
    # without walking os.environ for every line.
    global _env_secrets_cache
    now = time.monotonic()
    checked_at, size, cached = _env_secrets_cache
    if size == len(os.environ) and now - checked_at < _ENV_SECRETS_TTL_S:
        return cached
    values = {
        value
        for name, value in os.environ.items()
        if name.upper().endswith(_SECRET_ENV_SUFFIXES) and len(value) >= _MIN_ENV_SECRET
    }
    secrets = sorted(values, key=len, reverse=True)
    _env_secrets_cache = (now, len(os.environ), secrets)
    return secrets


# Each line is scrubbed twice (log.py: the structlog chain, then the
# formatter), and one search of _ANY_SECRET_SHAPE costs ~3 us: a dozen
# strings a line. The result depends on the configured keys' values.
_scrubbed = ShortStringMemo(max_chars=200, max_entries=4096)


def _scrub_str(text: str, env_secrets: list[str]) -> str:
    return _scrubbed.get(text, env_secrets, _scrub_uncached)


def _scrub_uncached(text: str, env_secrets: list[str]) -> str:
    for secret in env_secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    if _ANY_SECRET_SHAPE.search(text) is None:
        return text
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


@functools.lru_cache(maxsize=1024)  # field names: a few dozen, on every line
def _is_secret_field(name: str) -> bool:
    return bool(_SECRET_FIELD.search(name.lower().replace("-", "_")))


def _scrub_value(value: Any, env_secrets: list[str]) -> Any:
    kind = type(value)  # most fields: exact types, the cheapest tests first
    if kind is str:
        return _scrub_str(value, env_secrets)
    if kind in NO_TEXT_TYPES or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return _scrub_str(value, env_secrets)
    if isinstance(value, Mapping):
        return {
            key: (
                REDACTED
                if isinstance(key, str) and _is_secret_field(key) and value[key] is not None
                else _scrub_value(value[key], env_secrets)
            )
            for key in value
        }
    if isinstance(value, list | tuple | set | frozenset):
        return [_scrub_value(item, env_secrets) for item in value]
    # Paths, exceptions, arbitrary objects: their text is what a renderer would show.
    return _scrub_str(str(value), env_secrets)


def scrub(value: Any) -> Any:
    """Return `value` with credentials replaced by "[redacted]" (recursively)."""
    return _scrub_value(value, _env_secrets())


def scrub_secrets(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    """Processor: scrub every field, including a rendered `exception`."""
    # exc_info (True, a tuple or an exception) is rendered later, then scrubbed.
    exc_info = event_dict.pop("exc_info", None)
    stamp = event_dict.get(STAMP_FIELD)
    if is_stamp(STAMP_FIELD, stamp):  # the log's own: nothing to scrub (short_memo)
        del event_dict[STAMP_FIELD]
    else:
        stamp = None
    scrubbed: EventDict = scrub(event_dict)
    if stamp is not None:
        scrubbed[STAMP_FIELD] = stamp
    if exc_info is not None:
        scrubbed["exc_info"] = exc_info
    return scrubbed
