"""Buffer text that arrives in pieces (an LLM's output) into phrases worth synthesizing.

A phrase ends at sentence punctuation (. ! ? ; and their closing quotes/brackets) that is
followed by whitespace, or at a blank line. A boundary is only decided once the character after
it has arrived, so "3." + "14" or "example." + "com" never split. Known abbreviations ("Dr.",
"e.g.", "U.S.") and single initials never end a phrase. A phrase longer than `max_chars` is cut
at its last comma or space, never inside a word, number or URL. Pure Python; no I/O.
"""

from __future__ import annotations

import re

__all__ = ["ABBREVIATIONS", "PhraseBuffer"]

ABBREVIATIONS = frozenset(
    [
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "sr",
        "jr",
        "st",
        "vs",
        "etc",
        "e.g",
        "i.e",
        "a.m",
        "p.m",
        "no",
        "nos",
        "fig",
        "figs",
        "approx",
        "dept",
        "est",
        "inc",
        "ltd",
        "co",
        "corp",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
        "mon",
        "tue",
        "wed",
        "thu",
        "fri",
        "sat",
        "sun",
        "gen",
        "col",
        "lt",
        "sgt",
        "capt",
        "cmdr",
        "rev",
        "hon",
        "mt",
        "ft",
        "vol",
        "ch",
        "sec",
        "pp",
        "ed",
        "eds",
        "al",
        "cf",
        "viz",
        "ca",
    ]
)

# Sentence punctuation, optional closers, then the whitespace that confirms the boundary.
_BOUNDARY = re.compile(r"""[.!?;]+["'”’)\]]*(?=\s)|\n\s*\n""")
_WORD_BEFORE_DOT = re.compile(r"(\S+)\.$")


def _is_abbreviation(text_upto_dot: str) -> bool:
    """True if the '.' ending `text_upto_dot` belongs to an abbreviation or initial."""
    match = _WORD_BEFORE_DOT.search(text_upto_dot)
    if match is None:
        return False
    word = match.group(1).lstrip("\"'(“‘[").lower()
    if word in ABBREVIATIONS:
        return True
    if re.fullmatch(r"[a-z]", word):  # an initial: "J. Smith"
        return True
    # dotted acronyms: "U.S", "e.g" (the final dot is the one being examined)
    return re.fullmatch(r"(?:[a-z]\.)+[a-z]", word) is not None


class PhraseBuffer:
    def __init__(self, *, max_chars: int = 300, min_chars: int = 1) -> None:
        if max_chars < 20:
            raise ValueError(f"max_chars must be >= 20, got {max_chars}")
        if not (1 <= min_chars <= max_chars):
            raise ValueError(f"min_chars must be in [1, max_chars], got {min_chars}")
        self.max_chars = max_chars
        self.min_chars = min_chars
        self._buf = ""

    @property
    def pending(self) -> str:
        return self._buf

    def push(self, text: str) -> list[str]:
        """Add text; return the phrases now complete (stripped, non-empty), in order."""
        self._buf += text
        phrases: list[str] = []
        while True:
            cut = self._next_boundary()
            if cut is None:
                break
            phrase, self._buf = self._buf[:cut].strip(), self._buf[cut:]
            if phrase:
                phrases.append(phrase)
        return phrases

    def flush(self) -> str | None:
        """Return whatever is buffered as one phrase (None if only whitespace) and clear."""
        phrase, self._buf = self._buf.strip(), ""
        return phrase or None

    def _next_boundary(self) -> int | None:
        for match in _BOUNDARY.finditer(self._buf):
            end = match.end()
            if len(self._buf[:end].strip()) < self.min_chars:
                continue
            punct = match.group(0)
            if (
                punct.startswith(".")
                and punct.rstrip("\"'”’)]") == "."
                and _is_abbreviation(self._buf[: match.start() + 1])
            ):
                continue
            if end > self.max_chars:
                break
            return end
        if len(self._buf) > self.max_chars:
            return self._soft_cut()
        return None

    def _soft_cut(self) -> int | None:
        """Cut an over-long run at its last ', ' or whitespace within max_chars (never inside a token);
        a single token longer than max_chars is left whole until whitespace follows it."""
        window = self._buf[: self.max_chars + 1]
        comma = window.rfind(", ")
        if comma > 0:
            return comma + 1
        space = max(window.rfind(" "), window.rfind("\n"))
        if space > 0:
            return space
        nxt = re.search(r"\s", self._buf)
        return nxt.start() if nxt else None
