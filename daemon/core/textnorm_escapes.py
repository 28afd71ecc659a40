"""Escapes decoded where they stand, one family at a time (textnorm reads the
text with them decoded): JSON's and C's backslash escapes, CSS's, HTML
entities, URL encoding (%XX as UTF-8 bytes, %uXXXX), quoted-printable, and
code points as Unicode writes them (U+0054). A control character or a
broken escape becomes a space.
"""
from __future__ import annotations

import html
import re

from .textnorm_tables import is_format

# Quoted-printable's byte past ASCII: =XX runs that form one UTF-8 character.
_QP_CHAR = (r"=(?:[CD][0-9A-F]=[89AB][0-9A-F]|E[0-9A-F](?:=[89AB][0-9A-F]){2}"
            r"|F[0-7](?:=[89AB][0-9A-F]){3})")
# After its first "=": six bytes or more quoted in a row. Each pattern below
# keeps one literal "=" first (sre skips ahead to it; an alternation of
# patterns each with its own "=" is tried at every character).
_QP_RUN = r"[0-9A-Fa-f]{2}(?:=[0-9A-Fa-f]{2}){5,}"
# CSS's escape (\54 or \000054, a blank after it optional), read four or more in
# a row: one alone is a path's \dev or a backslash glued to a word.
_CSS = r"[0-9a-fA-F]{2,6} ?"
_CSS_CODE = re.compile(r"(?<=\\)[0-9a-fA-F]+")
# One pattern per escape family, each with a literal first character: the
# regex engine then skips ahead to it (a JSON log has only backslashes).
FAMILIES = (
    ("\\", re.compile(
        rf"\\(?:{_CSS}(?:\\{_CSS}){{3,}}|u\{{[0-9a-fA-F]{{1,6}}\}}|u[0-9a-fA-F]{{4}}"
        r"|U[0-9a-fA-F]{8}|x[0-9a-fA-F]{2}|[nrtbfv0\"'\\/`])")),
    ("&", re.compile(r"&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});?")),
    # %XX runs that form one UTF-8 character (1 to 4 bytes), and %uXXXX
    # (JavaScript's escape())
    ("%", re.compile(
        r"%(?:[uU][0-9a-fA-F]{4}|[0-7][0-9a-fA-F]"
        r"|[cdCD][0-9a-fA-F]%[89abAB][0-9a-fA-F]"
        r"|[eE][0-9a-fA-F](?:%[89abAB][0-9a-fA-F]){2}"
        r"|[fF][0-7](?:%[89abAB][0-9a-fA-F]){3})")),
    # Quoted-printable (RFC 2045, capitals): a character past ASCII, a quoted
    # space, tab or "=", the soft line break (nothing: the word goes on), and
    # a run of bytes each quoted (=54=68=65); read only in a text that is
    # quoted-printable (quoted_printable).
    ("=", re.compile(rf"=(?:{_QP_RUN}|{_QP_CHAR[1:]}|20|09|3D|\r?\n(?=\S))")),
    # Code points as Unicode writes them (U+0054 U+0068), four or more in a row.
    ("U", re.compile(r"U\+[0-9A-Fa-f]{4,6}(?:[ ,;]{0,3}U\+[0-9A-Fa-f]{4,6}){3,}")),
)
_QP_CHARS = re.compile(rf"=(?:{_QP_RUN}|{_QP_CHAR[1:]})")
_QP_SPACE = re.compile(r"=20(?=[A-Za-z])")
_CODE = re.compile(r"(?<=U\+)[0-9A-Fa-f]+")
_ONE_LETTER = {"n": " ", "r": " ", "t": " ", "b": " ", "f": " ", "v": " ", "0": " "}


def decode(m: re.Match[str]) -> str:
    """One escape, decoded; control characters and broken ones become a space."""
    s = m.group()
    if s[0] == "\\":  # the common case in a JSON log: one call, no loop
        if len(s) == 2:
            return _ONE_LETTER.get(s[1], s[1])
        if s[1] in "uUx":
            code = int(s[2:].strip("{}"), 16)
            out = chr(code) if code <= 0x10FFFF else " "
            return out if _shown(out) else " "
        out = _code_points(_CSS_CODE.findall(s))
    elif s[0] == "&":
        out = html.unescape(s)
    elif s[0] == "U":
        out = _code_points(_CODE.findall(s))
    elif s[1] in "\r\n":  # quoted-printable's soft line break
        return ""
    elif s[1] in "uU":  # %u0054
        out = chr(int(s[2:], 16))
    else:
        out = bytes.fromhex(s.replace(s[0], "")).decode("utf-8", "replace")
    return "".join(c if _shown(c) else " " for c in out) or " "


def _code_points(codes: list[str]) -> str:
    return "".join(chr(c) if (c := int(h, 16)) <= 0x10FFFF else " " for h in codes)


def _shown(ch: str) -> bool:
    """Printable, a space, or a format character (&shy; and &#x200B; are the
    soft hyphen and zero-width space: folding reads them inside a word)."""
    return ch.isprintable() or ch == " " or is_format(ch)


def quoted_printable(text: str) -> bool:
    """A character past ASCII as =XX bytes, six bytes quoted in a row, or
    three spaces quoted before a word (=20The)? Not a soft break (base64's
    padding) or =20 alone (code's "top_k=20", a claim's "mean=20% higher":
    its "=" and number stay)."""
    return _QP_CHARS.search(text) is not None or len(_QP_SPACE.findall(text)) >= 3
