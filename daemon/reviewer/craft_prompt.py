"""The episode blocks of the loss prompt: the contract between the loss
template and the built-in reviewer.

The loss handler writes each side's episodes under `=== Human EP NN ===` /
`=== Model EP NN ===` headers, closed by an end marker; the reviewer reads
them back out of the rendered prompt. Both directions live here so the two
cannot drift apart.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.errors import RefusedError

HUMAN_HEADER = "=== Human EP {n:02d} ==="
MODEL_HEADER = "=== Model EP {n:02d} ==="
# Closes a block so that template prose placed after the screenplays is not
# measured as part of the last episode.
END_MARKER = "=== End {kind} episodes ==="


_HEADERS = {"human": HUMAN_HEADER, "model": MODEL_HEADER}
_HEADER_RE = re.compile(r"^=== (Human|Model) EP (\d{2,}) ===\s*$")
_END_RE = re.compile(r"^=== End")


class CraftMetricsError(RefusedError):
    """Raised when the prompt holds no usable pair of screenplays, or a report
    would repeat screenplay text. The message names numbers only."""


def _trim_blank_lines(text: str) -> str:
    """Drop leading and trailing blank lines but keep the indentation of the rest."""
    lines = text.splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines)


def format_episodes(kind: str, episodes: Mapping[int, str]) -> str:
    """The prompt block for one side ("human" or "model"), episodes in order."""
    header = _HEADERS.get(kind.lower())
    if header is None:
        raise ValueError(f"kind must be 'human' or 'model', not {kind!r}")
    if not episodes:
        raise CraftMetricsError(f"no {kind} episodes to format")
    parts = []
    for n in sorted(episodes):
        body = _trim_blank_lines(episodes[n])
        if not body:
            raise CraftMetricsError(f"{kind} episode {n:02d} is empty")
        # A header-like line inside an episode would split or cut it when parsed.
        # Both kinds open with "===": an episode without it has none (one C call).
        if "===" in body and any(_HEADER_RE.match(line.strip()) or _END_RE.match(line.strip())
                                 for line in body.splitlines()):
            raise CraftMetricsError(f"{kind} episode {n:02d} contains an episode marker line")
        parts.append(f"{header.format(n=n)}\n\n{body}")
    parts.append(END_MARKER.format(kind=kind.capitalize()))
    return "\n\n".join(parts)


@dataclass(frozen=True)
class EpisodePair:
    """Both sides of the comparison, episode number -> text."""

    human: dict[int, str]
    model: dict[int, str]


def parse_episodes(text: str) -> EpisodePair:
    """Read the episode sections out of a prompt; refuse anything incomplete."""
    sides: dict[str, dict[int, str]] = {"Human": {}, "Model": {}}
    current: tuple[str, int] | None = None
    buffer: list[str] = []

    def close() -> None:
        if current is None:
            return
        kind, n = current
        if n in sides[kind]:
            raise CraftMetricsError(f"{kind.lower()} episode {n:02d} appears twice in the prompt")
        body = _trim_blank_lines("\n".join(buffer))
        if not body:
            raise CraftMetricsError(f"{kind.lower()} episode {n:02d} is empty in the prompt")
        sides[kind][n] = body

    for line in text.splitlines():
        header = _HEADER_RE.match(line.strip())
        if header or _END_RE.match(line.strip()):
            close()
            current = (header.group(1), int(header.group(2))) if header else None
            buffer = []
        elif current is not None:
            buffer.append(line)
    close()
    check_sides(sides["Human"], sides["Model"])
    return EpisodePair(human=sides["Human"], model=sides["Model"])


def check_sides(human: Mapping[int, str], model: Mapping[int, str]) -> None:
    """Refuse a comparison with an empty side or unmatched episode numbers."""
    missing = [k for k, side in (("human", human), ("model", model)) if not side]
    if missing:
        # Comparing against nothing gives a confident report about a gap that does not exist.
        raise CraftMetricsError(f"no {' and no '.join(missing)} episodes found in the prompt")
    if set(human) != set(model):
        raise CraftMetricsError(
            f"episode numbers differ: human {_numbers(human)}, model {_numbers(model)}"
        )


def _numbers(episodes: Iterable[int]) -> str:
    return ",".join(f"{n:02d}" for n in sorted(episodes))


def messages_text(messages: Sequence[Any]) -> str:
    """The text of all chat messages, joined: string contents and text parts."""
    chunks: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if content is None:
            content = getattr(message, "content", None)
        if isinstance(content, str):
            chunks.append(content)
        elif isinstance(content, list):
            chunks.extend(p["text"] for p in content if isinstance(p, Mapping) and "text" in p)
    return "\n".join(chunks)
