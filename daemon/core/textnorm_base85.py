"""Text in base85: Ascii85 (`base64.a85encode`, Adobe's `<~ ... ~>` too) and
base85 (`base64.b85encode`, Git's and ZeroMQ's alphabet).

The base64 module's other encodings: their alphabets hold punctuation that
base64's does not, so a run of them is not one of textnorm_encoded's runs.
A run here is `min_chars` characters or more of either alphabet, no space,
with letters of both cases and a character base64's alphabet has not (a
run of base64's characters only is read there, as base64, hex or a word).
Whichever of the five alignments of base85's groups reads as text in the
run's first PROBE_CHARS (what is glued before a run shifts them) decodes
the whole run. Prose has few long runs without a space (a path, a URL);
each costs a few decodes of PROBE_CHARS that fail (the decoders are Python).
"""
from __future__ import annotations

import base64
import bisect
import re
import string
from collections.abc import Callable

from .textnorm_tables import ONE_BYTE

PROBE_CHARS = 200  # 160 bytes: text or not, it says

_NOT_BASE64 = re.compile(r"[^A-Za-z0-9+/=_-]")
_LOWER, _UPPER = re.compile("[a-z]"), re.compile("[A-Z]")
# Ascii85: "!" to "u", and "z" for four zero bytes; Adobe's frame around it.
_A85_CHARS = "".join(map(chr, range(ord("!"), ord("u") + 1))) + "z"
_B85_CHARS = string.digits + string.ascii_letters + "!#$%&()*+-;<=>?@^_`{|}~"
_ADOBE = re.compile(r"<~[!-uz\s]+~>")


def decoded_runs(text: str, min_chars: int, as_text: Callable[[bytes], str | None]
                 ) -> list[tuple[int, int, str]]:
    """(start, end, text) of each run of `text` in Ascii85 or base85 that
    reads as text (`min_chars` and `as_text`: textnorm_encoded's)."""
    found: dict[tuple[int, int], str] = {}
    adobe = [m.span() for m in _ADOBE.finditer(text)] if "<~" in text else []
    starts = [start for start, _ in adobe]  # in order, apart: the frame a run may be in
    for spans, decode in ((adobe + _runs(text, _A85, min_chars), base64.a85decode),
                          (_runs(text, _B85, min_chars), base64.b85decode)):
        for span in spans:
            body = _unframed(text[span[0]:span[1]])
            if span in found or not _may_be_base85(body) or _framed(span, adobe, starts):
                continue
            for cut in range(5):
                if _decodes(decode, body[cut:cut + PROBE_CHARS], as_text) and \
                        (read := _decodes(decode, body[cut:], as_text)) is not None:
                    found[span] = read
                    break
    return [(start, end, read) for (start, end), read in found.items()]


def _framed(span: tuple[int, int], adobe: list[tuple[int, int]], starts: list[int]) -> bool:
    """Is the run inside an Adobe frame (read as the frame)?"""
    k = bisect.bisect_left(starts, span[0]) - 1
    return k >= 0 and adobe[k][1] > span[1]


def _marks(chars: str) -> bytes:
    """A translate table: the alphabet's bytes to "A", every other to " "."""
    return bytes(ord("A") if chr(b) in chars else ord(" ") for b in range(256))


_A85, _B85 = _marks(_A85_CHARS), _marks(_B85_CHARS)


def _runs(text: str, marks: bytes, min_chars: int) -> list[tuple[int, int]]:
    """(start, end) of each run of `min_chars` characters or more of an
    alphabet, found by bytes.translate and bytes.find (C: a regex over a 50 MiB
    log cost seconds)."""
    marked = text.encode("ascii", ONE_BYTE).translate(marks)  # a curly quote ends a run
    long = b"A" * min_chars
    spans = []
    start = marked.find(long)
    while start >= 0:
        end = marked.find(b" ", start)
        end = len(marked) if end < 0 else end
        spans.append((start, end))
        start = marked.find(long, end)
    return spans


def _may_be_base85(body: str) -> bool:
    """Both cases of letters and a character base64's alphabet has not. Base85
    of text spreads over its alphabet: a run of 24 without a lower-case letter
    is about 1 in 1,000, without a capital 1 in 6,000, fewer the longer the
    run. A timestamp ("2026-01-01T00:00:00.000Z",) has no lower case, a path
    seldom a capital; a run of base64's characters only is read there."""
    return (_NOT_BASE64.search(body) is not None and _LOWER.search(body) is not None
            and _UPPER.search(body) is not None)


def _decodes(decode: Callable[[str], bytes], body: str,
             as_text: Callable[[bytes], str | None]) -> str | None:
    try:
        return as_text(decode(body))
    except ValueError:  # binascii.Error is one
        return None


def _unframed(run: str) -> str:
    """Adobe's Ascii85 without its frame and line breaks."""
    return "".join(run[2:-2].split()) if run.startswith("<~") and run.endswith("~>") else run
