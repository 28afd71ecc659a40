"""Reading a loss report's claims list (craft_claims checks what is read).

Reviewers write the list as people do: "much higher", "compared with the
original, higher", "similar (slightly higher)", "lower for the human",
"longer", "about the same", the model's "`speech_words_mean` (12.1 vs 8.3)",
an em dash for the colon, a table, sub-headings, two sections, a heading
"## 5. Claims (model vs. human)" or a bold **Claims** line. So the direction
is read wherever it stands in the value, the statistic wherever it stands in
the name, and every Claims section is read: a qualifier or a layout must not
turn a wrong claim into an unreadable one, which would count for nothing,
nor an honest one. A line that tries to be a claim (a separator with a
direction after it) and cannot be read is reported by line number and
reason, never a crash; prose beside the claims is passed over.
Pure, no I/O; numbers and statistic names only, never screenplay text.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from ..core import textnorm
from .craft_metrics import METRICS, Metric

SECTION = "Claims"
DIRECTIONS = ("higher", "lower", "similar")
# The prompt's own words for a direction (prompts/loss.md.j2: "longer,
# shorter, more, fewer"), and "the same", "about the same", "equal".
_SYNONYMS = {"longer": "higher", "more": "higher", "shorter": "lower", "fewer": "lower",
             "less": "lower", "greater": "higher", "larger": "higher", "bigger": "higher",
             "smaller": "lower", "same": "similar", "equal": "similar"}
# "more", "less", "fewer" say how much only alone, before "than" or "of", or
# before what the statistics count ("more scenes"); before any other word they
# are a manner ("more clipped", "more sparing", "more evenly spread"), which
# says nothing of the number, often the opposite: it claims nothing.
_QUANTIFIERS = frozenset({"more", "less", "fewer"})
_COUNTED = frozenset({"than", "of", "scenes", "scene", "speeches", "speech", "words", "word",
                      "dialogue", "parentheticals", "questions", "exclamations",
                      "exclamation", "transitions", "characters", "speakers", "lines"})
_PLAIN = {d: d for d in DIRECTIONS}
_DIRECTION_WORDS = {**_PLAIN, **_SYNONYMS}
# A label's note and its part after a comma are dropped in writing: "Words
# per speech" for "Words per speech (mean)", "Scene length" for "Scene
# length, mean (words)".
_LABEL_NOTE = re.compile(r"\s*\([^()]*\)|,\s.*$")


def _names() -> dict[str, Metric]:
    names: dict[str, Metric] = {}
    for m in METRICS:
        names[m.key] = names[m.label.lower()] = m
    for m in METRICS:  # a shortened label never takes another statistic's name
        for short in (_LABEL_NOTE.sub("", m.label.lower()), re.sub(r"\s*\([^()]*\)", "",
                                                                    m.label.lower())):
            names.setdefault(short.strip(), m)
    return names


BY_NAME: dict[str, Metric] = _names()
# A statistic by how a reader reads its key or its label: words joined.
_BY_READING: dict[str, Metric] = {
    "".join(textnorm.words_as_read(name)): m for name, m in BY_NAME.items()}
_NAME_WORDS = max(len(textnorm.words_as_read(name)) for name in BY_NAME)  # most of any name
# A label that is only a direction, for the model: "Higher", "Lower in the model".
_LABEL_DIRECTION = re.compile(r"(?:higher|lower|similar)(?: (?:in|for) (?:the )?model)?")
# An unknown statistic's name is kept (not checkable) up to this many words.
UNKNOWN_NAME_WORDS = 4
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s*(.*?)\s*#*\s*$")
# A Claims heading's text: "Claims", "5. Claims", "Measurable claims",
# "Claims (model vs. human)", "Claims: model against human", bold or not.
_SECTION = re.compile(rf"^[^\w(]*(?:(?:\d+|[IVX]+)[.)]\s*|\d+\s+)?(?:[\w-]+\s+){{0,3}}"
                      rf"{SECTION}\b(?:\s+[\w-]+){{0,5}}[^\w(:\u2014\u2013-]*"
                      r"(?:[:(\u2014\u2013-].*)?$", re.IGNORECASE)
# ...but not a heading about claims: "Notes on the claims", "Why these claims matter".
_ABOUT_CLAIMS = re.compile(rf"\b(?:the|these|those|on|about|for|why|our|my|its|their|such|"
                           rf"no|any|of)\s+{SECTION}\b", re.IGNORECASE)
# A line that is only "Claims:" heads a list as a bold line does.
_LABEL_LINE = re.compile(rf"^\s*({SECTION})\s*:\s*$", re.IGNORECASE)
_MARKS = re.compile(r"[*_]")  # bold or italic around a heading's words
# A line wholly in bold ("**Claims**", "__Next steps:__"): a heading in all but markup.
_BOLD_LINE = re.compile(r"^\s*(\*\*|__)(.+?)\1\s*:?\s*$")
_BULLET = re.compile(r"^(?:[-*+•]|\d+[.)])\s+")
_FENCE = re.compile(r"^\s*(```|~~~)")
_MARKDOWN_FENCE = re.compile(r"^\s*(```|~~~)\s*(markdown|md)\s*$", re.IGNORECASE)
# A Markdown rule, a table's |---|:--:| or a thematic break: layout, not a claim.
_RULE = re.compile(r"^[\s|:]*-[\s|:-]*$")
# Between a statistic and its direction, in textnorm's reading of the line
# (where an em or en dash is "-"): a colon, "=", a table's "|", a dash apart
# from a word on one side, or "is"/"are". A hyphen inside a word does not
# split it: "speech-words-mean" names a statistic.
_SEPARATOR = re.compile(r"[:=|\u2192\u21d2\u27f6\u21a6]|\s-+|-+\s|--+|\b(?:is|are)\b",
                        re.IGNORECASE)
# A line with none of them may have an em dash between words, read as a
# hyphen: "speech_words_mean—higher". The dash is then the last one before
# the direction, so that a hyphenated name stays whole.
_DASH = re.compile(rf"-+(?=[^-]*?\b(?:{'|'.join(DIRECTIONS)})\b)", re.IGNORECASE)
# Words that, before a direction in its clause, deny it: "higher, not lower as
# the draft suggests" claims higher; "not higher" alone claims nothing.
_NEGATION = frozenset({"not", "no", "never", "nor", "neither", "isnt", "arent", "wasnt",
                       "werent", "dont", "doesnt", "didnt", "wont", "cant", "cannot",
                       "couldnt", "hasnt", "havent", "hadnt", "shouldnt", "wouldnt",
                       "hardly", "barely", "scarcely", "without", "nothing", "none"})
# The human's side as the subject ("the human's is higher", "human higher",
# "lower for the human"): the model's is the other way, read so and checked,
# or a wrong claim could hide there.
_HUMAN = frozenset({"human", "humans", "original", "originals", "reference", "references",
                    "source", "sources"})
_INVERSE = {"higher": "lower", "lower": "higher", "similar": "similar"}
# The human's side is the subject first in its clause, after a word that
# starts a new subject ("while the original's is higher") or as the place a
# direction is said of ("higher in the original", "for the human it is").
# After one of _AGAINST it is what the model is measured against ("compared
# with the original", "above the human's", "outpaces the original"); after a
# direction, a new subject's clause ("lower while the original leans on
# action lines") says nothing of the model's. After any other word its role
# is a guess: the claim is unreadable, not read one way (a wrong claim read
# backwards is confirmed).
_NEW_SUBJECT = frozenset({"while", "whilst", "whereas", "but", "and", "though", "although",
                          "yet", "where", "when", "since", "because", "so"})
_PLACE = frozenset({"for", "in", "on", "at", "among", "within", "of"})
_AGAINST = frozenset({"with", "to", "than", "against", "versus", "vs", "unlike", "over",
                      "from", "relative", "compared", "beside", "as", "like", "above",
                      "below", "under", "beyond", "behind", "ahead", "past", "exceeds",
                      "exceed", "outpaces", "outpace", "outstrips", "surpasses", "trails",
                      "trail", "tops", "per", "see", "according"})
# Skipped back to the word that says the human's side's role: articles, "'s".
_ARTICLES = frozenset({"the", "a", "an", "its", "their", "s"})
# A statistic's own words: in a name ("speech_words_mean, human vs model") they
# start the clause the human's side is read in.
_STATISTIC_WORDS = frozenset(w for name in BY_NAME for w in textnorm.words_as_read(name)) \
    - _NEW_SUBJECT - _PLACE - _AGAINST - _ARTICLES
AMBIGUOUS = "ambiguous"  # _said: a direction said beside the human's side, role unknown
# A parenthesis is commentary on the claim beside it: "similar (slightly higher)".
_ASIDE = re.compile(r"\([^()]*\)?|\[[^\[\]]*\]?")
# Where a clause ends, in textnorm's reading: "compared with the original, higher".
_CLAUSE = re.compile(r"[,;:.!?|]|\s-+\s")
# "human: lower" is one clause, the human's side named as a label.
_HUMAN_LABEL = re.compile(r"\b((?:human|original)\w*(?:['\u2019]s)?)\s*:", re.IGNORECASE)


@dataclass(frozen=True)
class Claim:
    statistic: str  # as written, normalised to lower case
    direction: str  # higher | lower | similar: the model's value against the human's
    line: int  # 1-based line of the report


@dataclass(frozen=True)
class ClaimList:
    """What the report's claims section said; found=False: it has none."""

    found: bool
    claims: tuple[Claim, ...] = ()
    malformed: tuple[tuple[int, str], ...] = ()  # (line, why), no text of the line
    # Those of the malformed lines that name a statistic of the tables: a claim
    # about it that could not be read (a prose line may only look like one).
    naming: tuple[int, ...] = ()


def read_claims(report: str) -> ClaimList:
    """The claims of every Claims section (any heading level, or a bold line):
    a later section must not hide a wrong claim of an earlier one, nor the reverse."""
    lines = report.splitlines()
    sections = list(_sections(lines))
    if not sections:
        return ClaimList(found=False)
    claims: list[Claim] = []
    malformed: list[tuple[int, str]] = []
    results = [(start, *_read_section(lines, start, end)) for start, end in sections]
    any_read = any(read for _s, read, _u, _p in results)
    for start, read, unread, prose in results:
        if not read and not any_read:
            unread = sorted(unread + prose)
            if not unread:
                unread.append((start, "the claims section is empty"))  # its heading's line
        claims += read
        malformed += unread
    naming = tuple(n for n, _ in malformed if 0 < n <= len(lines) and _statistics_in(
        textnorm.words_as_read(lines[n - 1])))
    return ClaimList(found=True, claims=tuple(claims), malformed=tuple(malformed),
                     naming=naming)


def _heading(line: str, inside: int) -> tuple[int, str] | None:
    """(depth, text) of a heading; a bold line is one below every `#` level,
    and only outside a `#` section (inside=depth of the open section, 0: none),
    where it would be a "**Next steps**" among the claims."""
    m = _HEADING.match(line)
    if m is not None:
        return len(m.group(1)), m.group(2)
    bold = _BOLD_LINE.match(line) or _LABEL_LINE.match(line)
    if bold is not None and not 0 < inside <= 6:
        return 7, bold.group(bold.lastindex or 0)
    return None


def _sections(lines: list[str]) -> Iterator[tuple[int, int]]:
    """(start, end) line indexes of each Claims section's body: from below
    its heading to the next heading of its level or above, or the end."""
    start, level = None, 0
    fence: str | None = None  # inside one: "code", or "markdown" (its headings are read)
    for i, line in enumerate(lines):
        if _FENCE.match(line):
            fence = None if fence else "markdown" if _MARKDOWN_FENCE.match(line) else "code"
        fenced = fence == "code"
        heading = None if fenced else _heading(line, level if start is not None else 0)
        if heading is None:
            continue
        depth, text = heading
        if start is not None:
            if depth > level:
                continue  # a sub-heading ("### Dialogue"): its claims are the section's
            yield start, i
        text = _MARKS.sub("", text).strip()
        named = _SECTION.match(text) and not _ABOUT_CLAIMS.search(text)
        start, level = (i + 1, depth) if named else (None, 0)
    if start is not None:
        yield start, len(lines)


def _read_section(lines: list[str], start: int,
                  end: int) -> tuple[list[Claim], list[tuple[int, str]], list[tuple[int, str]]]:
    """The claims of lines[start:end], and (line, why) for each line that tries
    to be one (_claim_like) and is not. Other prose ("**Next steps**" and its
    bullets) is passed over, unless the section has no claim to pass it for."""
    claims: list[Claim] = []
    malformed: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    for i in range(start, end):
        line = lines[i].strip()
        if (not line or _FENCE.match(line) or _RULE.match(line)
                or _HEADING.match(lines[i]) or _table_header(lines, i)):
            continue  # layout; a table header ("| statistic | direction |") names columns
        split = _name_and_value(_BULLET.sub("", line))  # cut once: both below read it
        claim = _read_line(split, i + 1)
        if isinstance(claim, tuple):
            claims += claim
        else:
            (malformed if _claim_like(split) else prose).append((i + 1, claim))
    return claims, malformed, [] if claims else prose


def _table_header(lines: list[str], i: int) -> bool:
    """Line i is a Markdown table's header: the next line is the table's rule."""
    below = lines[i + 1].strip() if i + 1 < len(lines) else ""
    return "|" in below and _RULE.match(below) is not None


def _read_line(split: tuple[str, str] | None, number: int) -> tuple[Claim, ...] | str:
    """The claim of one `statistic: direction` line, cut by _name_and_value
    (None: no separator), numbered `number` (a direction's label before
    statistics, "**Lower:** dialogue_share, scene_words_cv": one claim each), or
    why it is not one.

    Read through the guard's normalisation (textnorm), as a person reads it:
    `speech_words_mean`, **Speech words mean** and spee&#96;ch_words_mean
    name one statistic, and so does "The model's speech_words_mean" or
    "speech_words_mean (12.1 vs 8.3)". What is kept is the statistic's key
    from the facts table, or, for a name the table lacks, its first words
    (at most UNKNOWN_NAME_WORDS): never more of the line than a name, so no
    passage of a report reaches the sidecar through a claim (issue 34).
    """
    if split is None:
        return "not 'statistic: higher|lower|similar'"
    name, value = split
    grouped = _direction_label(name)
    if grouped:  # grouped by direction: "**Higher:** speech_words_mean"
        name, value = value, name
    name = _ASIDE.sub(" ", name)
    read = textnorm.words_as_read(name)
    named = _statistics_in(read)
    # A synonym ("fewer") only for a statistic of the table: "Its scenes are
    # fewer" is prose, not a claim about a statistic called "its scenes".
    direction = _direction(value, _DIRECTION_WORDS if named else _PLAIN)
    if direction not in DIRECTIONS:
        return direction
    if not read:
        return "no statistic named"
    if (human := _of_the_human(read)) is None and direction != "similar":
        return "the human's side in the name in no role a reader can tell"
    if human:  # "The human's speech_words_mean is lower"
        direction = _INVERSE[direction]
    if len(named) > 1 and not grouped:
        return "more than one statistic named"
    if named:
        return tuple(Claim(statistic=m.key, direction=direction, line=number)
                     for m in METRICS if m in named)
    words = textnorm.tokens(name)
    if len(words) > UNKNOWN_NAME_WORDS:
        return "not a statistic of the facts table, nor a name"
    return (Claim(statistic="_".join(words), direction=direction, line=number),)


def _statistics_in(words: list[str]) -> set[Metric]:
    """The statistics some words name, the longest name first: "scene length
    spread" names scene_words_cv, not scene_words_mean's "scene length"."""
    found: set[Metric] = set()
    taken = [False] * len(words)
    for n in range(min(_NAME_WORDS, len(words)), 0, -1):
        for i in range(len(words) - n + 1):
            metric = _BY_READING.get("".join(words[i:i + n]))
            if metric is not None and not any(taken[i:i + n]):
                found.add(metric)
                taken[i:i + n] = [True] * n
    return found


def _claim_like(split: tuple[str, str] | None) -> bool:
    """The line (cut by _name_and_value) is a claim, if an unreadable one: it
    has a separator with a direction after it ("speeches ran: higher"), a
    statistic alone before it
    ("scene_words_mean is long", "speech_words_mean was lower"), or a
    direction alone before statistics ("Lower: dialogue_share, scene_words_cv").
    A next-steps bullet, even one naming a statistic ("- Bring speech_words_mean
    down."), is prose."""
    if split is None:
        return False
    name = "".join(textnorm.words_as_read(_ASIDE.sub(" ", split[0])))
    value = textnorm.words_as_read(split[1])
    if _direction_label(split[0]):
        return bool(_statistics_in(value))
    return name in _BY_READING or not set(value).isdisjoint(_DIRECTION_WORDS)


def _direction_label(name: str) -> bool:
    """The name side is only a direction for the model: "**Higher:**", "Lower in the model"."""
    return _LABEL_DIRECTION.fullmatch(" ".join(textnorm.words_as_read(name))) is not None


def _name_and_value(line: str) -> tuple[str, str] | None:
    """A claim line cut at its first separator (a table row: after the first
    cell that names a statistic, else its first cell, as "| 1 | speech_words_mean
    | lower |" numbers its rows); None: it has none. Cut in textnorm's reading
    of the line, where an em dash, "&mdash;" and a full-width colon are the
    ASCII "-" and ":"."""
    text = textnorm.readings(line)[0].text
    if text.startswith("|"):
        cells = text.strip().strip("|").split("|")
        for k, cell in enumerate(cells[:-1]):
            if _statistics_in(textnorm.words_as_read(_ASIDE.sub(" ", cell))):
                return cell, "|".join(cells[k + 1:])
        text = text.removeprefix("|")
    m = _SEPARATOR.search(text) or _DASH.search(text)
    if m is None:  # "speech_words_mean was lower": cut after the name the line starts with
        tokens = re.findall(r"\S+", text)
        first = "".join(textnorm.words_as_read(tokens[0])) if tokens else ""
        if not first or not any(name.startswith(first) for name in _BY_READING):
            return None  # prose: no name starts so (read once, not once a length)
        for k in range(min(len(tokens), _NAME_WORDS), 0, -1):  # a name is no longer
            head = " ".join(tokens[:k])
            if "".join(textnorm.words_as_read(head)) in _BY_READING:
                return head, " ".join(tokens[k:])
        return None
    return (text[:m.start()], text[m.end():])


def _direction(value: str, meaning: dict[str, str]) -> str:
    """The one direction a claim's value names for the model, wherever it stands
    ("much higher"); else why there is none (a sentence, never one of DIRECTIONS).
    One in a parenthesis is commentary unless it is the only one ("5 (higher)")."""
    value = _HUMAN_LABEL.sub(r"\1 ", value)
    outside = _ASIDE.sub(",", value)
    said = _said(outside, _PLAIN)  # a plain direction first: a synonym beside it is commentary
    if all(d is None for d in said):
        said = _said(outside, meaning) or _said(value, meaning)
    if not said:
        return "the direction must be higher, lower or similar"
    if AMBIGUOUS in said:
        return ("the human's side beside the direction in no role a reader can tell: say it "
                "of the model's ('higher', 'higher than the original')")
    claimed = {d for d in said if d is not None}
    if not claimed:
        return "a direction negated or a manner ('more clipped'), none claimed"
    if len(claimed) > 1:
        return "more than one direction: higher, lower or similar, one of them"
    return claimed.pop()


def _said(text: str, meaning: dict[str, str]) -> list[str | None]:
    """Each direction `text` names (its words read by `meaning`), as the model's
    value against the human's: inverted where said of the human's (before it,
    or after it: "lower for the human"), None where denied. A word turns only
    the direction after it in its clause: "higher, not lower" claims higher."""
    said: list[str | None] = []
    for clause in _CLAUSE.split(text):
        words = textnorm.words_as_read(clause)
        at = [i for i, word in enumerate(words) if word in meaning]
        for k, i in enumerate(at):
            before = words[at[k - 1] + 1 if k else 0:i]
            after = words[i + 1:at[k + 1] if k + 1 < len(at) else len(words)]
            word = meaning[words[i]]
            if _NEGATION.intersection(before):
                said.append(None)
            elif words[i] in _QUANTIFIERS and i + 1 < len(words) and not (
                    words[i + 1] in _COUNTED or words[i + 1].isdigit()):
                said.append(None)
            elif ((human := _of_the_human(before)) is None or (
                    human is False and (human := _for_the_human(after)) is None)) \
                    and word != "similar":  # similar either way round
                said.append(AMBIGUOUS)
            else:
                said.append(_INVERSE[word] if human else word)
    return said


def _of_the_human(words: list[str]) -> bool | None:
    """These words before a direction have the human's side for their subject
    ("the human's is", "human", "while the original's is", "for the human it
    is"): True; only as what the model is compared with ("compared with the
    human", "above the human's"), or not at all: False; None: its role unknown."""
    before = ""  # the last word before it, articles and the human's own words skipped
    compared = False  # a comparison word came first: "52 % vs 23 % in the original"
    for word in words:
        if word in _HUMAN:
            if compared:
                continue
            if not before or before in _NEW_SUBJECT or before in _PLACE:
                return True
            if before not in _AGAINST:
                return None
        elif word not in _ARTICLES:
            before = "" if word in _STATISTIC_WORDS else word
            compared = compared or word in _AGAINST
    return False


def _for_the_human(words: list[str]) -> bool | None:
    """The words after a direction say it of the human's side ("lower for the
    human", "higher but only in the original"): True; not (what the model is
    measured against, "higher than in the original"; the subject of another
    clause, "lower while the original leans ..."; no human's side): False;
    None: the human's side after another word ("higher the original")."""
    before = ""
    for word in words:
        if word in _AGAINST or word in _NEGATION:
            return False
        if word in _HUMAN:
            return True if before in _PLACE else False if before in _NEW_SUBJECT else None
        if word not in _ARTICLES:
            before = word
    return False
