"""Screenplay parsing: an episode in Fountain-like plain text, split into the
elements the craft statistics count (scenes, speeches, action paragraphs,
transitions), with each line's words counted once.

Why not a Fountain library: screenplain 0.12 (the kept parser on PyPI) was
measured against this parser on data/example (12 episodes) and on the public
"Brick & Steel" Fountain sample. It parses the full spec (title page, forced
elements, notes, dual dialogue), which this does not, but on the text our
writers produce it is wrong where this is right, it is no faster (1.15 ms
against 1.11 ms per example episode, parsing only, before any word counting),
and it brings reportlab for its PDF export:
- a first line such as "EPISODE 1: Low Water" is read as a title-page key;
- a scene heading followed by action without a blank line (common in LLM
  output) becomes a character cue with the action as its dialogue;
- "FADE OUT." is action, not a transition;
- cue extensions stay in the name ("DEV (CONT'D)" is another speaker than
  "DEV").
The statistics need only the four elements above, so the rules here are the
few Fountain rules that decide them, tolerant of what an LLM writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_WORD_RE = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
_HEADING_RE = re.compile(
    r"^(?:\d+[A-Z]?\s+)?(?:INT\.?/EXT\.?|EXT\.?/INT\.?|I/E\.?|INT\.|EXT\.|INT |EXT )"
)
_TRANSITION_RE = re.compile(r"^(?:[A-Z][A-Z ]*TO:|FADE IN:|FADE OUT\.?|FADE TO BLACK\.?)$")
_CUE_EXTENSION_RE = re.compile(r"\s*\([^)]*\)\s*")
_CUE_NAME_RE = re.compile(r"^[^\W\d_][^\W_]*(?:[ .'’-]+[^\W_]+)*$")


# The same rule in ASCII bytes, for the rare line that needs it (below).
_ASCII_WORD_RE = re.compile(rb"[A-Za-z0-9]+(?:'[A-Za-z0-9]+)*")
# Typography an LLM writes, as the rule reads it: a curly apostrophe joins
# like "'", the rest parts words like a space.
_TYPOGRAPHY = (("\u2019", "'"), *((c, " ") for c in "\u2018\u201c\u201d\u2014\u2013\u2026\u00a0"))
# ASCII as the rule sees it: letters, digits, "'" and the line breaks kept,
# anything else a space.
_WORD_BYTES = bytes(c if chr(c).isalnum() and c < 128 or chr(c) in "'\n\r" else 32
                    for c in range(256))
# Breaks str.splitlines() sees and bytes.splitlines() does not.
_STR_ONLY_BREAKS = "\x0b\x0c\x1c\x1d\x1e"


def count_words(text: str) -> int:
    return len(_WORD_RE.findall(text))


def line_word_counts(text: str) -> list[int]:
    """count_words of each of text.splitlines(), in a few C calls a line: the
    regex's Unicode class costs ~60 ns a character, most of an episode's parse."""
    plain = text
    for typographic, ascii_ in _TYPOGRAPHY:
        if typographic in plain:
            plain = plain.replace(typographic, ascii_)
    if not plain.isascii() or any(c in plain for c in _STR_ONLY_BREAKS):
        return [count_words(line) for line in text.splitlines()]
    return [len(line.split()) if b"'" not in line else _words_around_apostrophes(line)
            for line in plain.encode("ascii").translate(_WORD_BYTES).splitlines()]


def _words_around_apostrophes(line: bytes) -> int:
    # Letters, digits, "'" and spaces only. Without "''", every "'" inside a
    # token joins two runs of letters or hangs at its end, so a token is a
    # word unless it is a lone "'".
    if b"''" in line:
        return len(_ASCII_WORD_RE.findall(line))
    words = line.split()
    return len(words) - words.count(b"'")


def is_scene_heading(line: str) -> bool:
    return bool(_HEADING_RE.match(line.strip()))


def is_transition(line: str) -> bool:
    return bool(_TRANSITION_RE.match(line.strip()))


def cue_name(line: str) -> str | None:
    """The character named by a cue line (extensions removed), or None if not a cue."""
    s = line.strip()
    if is_scene_heading(s) or is_transition(s):
        return None
    return _cue_of(s)


def _cue_of(s: str) -> str | None:
    """cue_name of a stripped line known to be no heading and no transition."""
    if "(" not in s and s != s.upper():  # most lines: lower case, and no extension
        return None
    # The extension may be lower case, "(into phone)"; the name itself may not.
    name = " ".join(_CUE_EXTENSION_RE.sub(" ", s).rstrip("^ ").split())
    if not name or name != name.upper() or len(name) > 30 or len(name.split()) > 4:
        return None
    return name if _CUE_NAME_RE.match(name) else None


@dataclass(frozen=True)
class Speech:
    """One character cue with its dialogue."""

    character: str
    words: int
    parentheticals: int
    has_question: bool


@dataclass(frozen=True)
class Breakdown:
    """The measured elements of one episode."""

    words: int
    scene_words: tuple[int, ...]
    speeches: tuple[Speech, ...]
    action_blocks: tuple[int, ...]  # words per action paragraph
    transitions: int
    exclamations: int


def parse_screenplay(text: str) -> Breakdown:
    """Split an episode into scenes, speeches, action paragraphs and transitions.

    One pass over the stripped lines, each line's word count taken once
    (line_word_counts). A speech is a cue after a blank line with a line of
    dialogue under it (Fountain's rule), and runs to a blank line or a scene
    heading. Written out in one function: this loop is most of a job's own
    CPU after the LLM call's (bench/RESULTS.md, issue 36).
    """
    lines = [line.strip() for line in text.splitlines()]
    words = line_word_counts(text)  # a word never spans a line break
    heading = [bool(s) and _HEADING_RE.match(s) is not None for s in lines]
    n = len(lines)
    scenes: list[int] = []
    speeches: list[Speech] = []
    blocks: list[int] = []
    transitions = 0
    after_blank, in_action = True, False
    i = 0
    while i < n:
        s = lines[i]
        if not s:
            after_blank, in_action = True, False
        elif heading[i]:
            scenes.append(0)
            after_blank, in_action = True, False
        elif s.isupper() and _TRANSITION_RE.match(s):  # a transition has no lower case
            transitions += 1
            after_blank, in_action = True, False
        elif (after_blank and i + 1 < n and lines[i + 1] and not heading[i + 1]
              and (name := _cue_of(s)) is not None):
            end = _speech_end(lines, heading, i + 1)
            speeches.append(_speech(name, lines, words, i + 1, end))
            if scenes:
                scenes[-1] += sum(words[i + 1 : end])
            i, after_blank, in_action = end, False, False
            continue
        else:
            if not in_action:
                blocks.append(0)
            blocks[-1] += words[i]
            if scenes:
                scenes[-1] += words[i]
            after_blank, in_action = False, True
        i += 1
    return Breakdown(
        words=sum(words),
        scene_words=tuple(scenes),
        speeches=tuple(speeches),
        action_blocks=tuple(blocks),
        transitions=transitions,
        exclamations=text.count("!"),
    )


def _speech_end(lines: list[str], heading: list[bool], i: int) -> int:
    """The first line from `i` that ends a speech: blank, a heading, or the end."""
    n = len(lines)
    while i < n and lines[i] and not heading[i]:
        i += 1
    return i


def _speech(name: str, lines: list[str], words: list[int], start: int, end: int) -> Speech:
    """The speech whose dialogue is lines start..end-1."""
    spoken = parens = 0
    question = in_paren = False
    for k in range(start, end):
        s = lines[k]
        if in_paren or s.startswith("("):
            parens += 0 if in_paren else 1
            in_paren = not s.endswith(")")
        else:
            spoken += words[k]
            question = question or "?" in s
    return Speech(name, spoken, parens, question)
