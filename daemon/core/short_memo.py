"""A memo for a text function applied to the short strings every log line
repeats (event, run, work, range and logger names, paths): kept per owner,
the thing the result depends on (the configured keys, the answer keys), and
emptied when the owner changes or the memo is full. Long strings are not kept.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

Owner = TypeVar("Owner")

# Field types that carry no text: nothing to scrub or seal in them.
NO_TEXT_TYPES = frozenset({type(None), bool, int, float})
# A line's own time, stamped by the log itself (structlog's TimeStamper, which
# overwrites any value a caller gave): no outside text in it. New on every
# line, it was a third of a line's scrub and seal, and it filled the memos
# with strings never seen again (each emptied every ~1,000 lines). Passed over
# only in the stamper's exact form: a record that skipped our chain (a
# library's own structlog chain) may carry any text under the name.
STAMP_FIELD = "timestamp"
_STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,6})?Z")


def is_stamp(key: str, value: Any) -> bool:
    """Is this field the log's own timestamp (nothing to scrub or seal in it)?"""
    return key == STAMP_FIELD and type(value) is str and _STAMP.fullmatch(value) is not None


class ShortStringMemo:
    def __init__(self, max_chars: int, max_entries: int) -> None:
        self.max_chars, self.max_entries = max_chars, max_entries
        # One tuple, swapped whole: threads logging at once see a consistent pair.
        self._held: tuple[Any, dict[str, str]] = (None, {})

    def get(self, text: str, owner: Owner, compute: Callable[[str, Owner], str]) -> str:
        """compute(text, owner), from the memo when `text` was seen under an equal owner."""
        if len(text) > self.max_chars:
            return compute(text, owner)
        held, seen = self._held
        if held != owner or len(seen) >= self.max_entries:
            seen = {}
            self._held = (owner, seen)
        result = seen.get(text)
        if result is None:
            result = seen[text] = compute(text, owner)
        return result
