"""PhraseBuffer: phrase boundaries under every way of cutting the same text into pieces."""

from __future__ import annotations

import numpy as np
import pytest

from tilevox.server.text_buffer import PhraseBuffer


def _stream(text: str, cuts: list[int], **kw) -> list[str]:
    buf = PhraseBuffer(**kw)
    out: list[str] = []
    prev = 0
    for c in sorted(cuts) + [len(text)]:
        out += buf.push(text[prev:c])
        prev = c
    tail = buf.flush()
    return out + ([tail] if tail else [])


CASES = [
    ("Hello there. How are you? Fine!", ["Hello there.", "How are you?", "Fine!"]),
    ("Pi is 3.14159 today. Next.", ["Pi is 3.14159 today.", "Next."]),
    ("It costs $1,299.99, or 1.5 million. Right.", ["It costs $1,299.99, or 1.5 million.", "Right."]),
    ("Dr. Smith met Mr. J. Doe at 5 p.m. yesterday. Ok.", ["Dr. Smith met Mr. J. Doe at 5 p.m. yesterday.", "Ok."]),
    (
        "See https://example.com/a.b?x=1.2 for more. Then go.",
        ["See https://example.com/a.b?x=1.2 for more.", "Then go."],
    ),
    ("Use e.g. this, i.e. that. Done.", ["Use e.g. this, i.e. that.", "Done."]),
    ("The U.S. Army won. Then.", ["The U.S. Army won.", "Then."]),
    ('He said "stop." Then left.', ['He said "stop."', "Then left."]),
    ("Para one\n\nPara two", ["Para one", "Para two"]),
    ("Version 2.0.1 shipped.", ["Version 2.0.1 shipped."]),
]


@pytest.mark.parametrize("text,expected", CASES)
def test_phrases_independent_of_chunking(text, expected):
    assert _stream(text, []) == expected
    rng = np.random.default_rng()
    for _ in range(30):  # random piece boundaries, including 1-character pieces
        cuts = sorted(set(rng.integers(1, len(text), size=rng.integers(1, len(text))).tolist()))
        assert _stream(text, cuts) == expected, cuts
    assert _stream(text, list(range(1, len(text)))) == expected


def test_boundary_waits_for_following_character():
    buf = PhraseBuffer()
    assert buf.push("Pi is 3.") == []
    assert buf.push("14 ok. ") == ["Pi is 3.14 ok."]


def test_long_run_cut_at_comma_or_space_never_inside_tokens():
    words = [f"w{i}" for i in range(100)] + ["https://example.com/very/long/path.html", "12,345.67"]
    text = " ".join(words) + " end"
    phrases = _stream(text, [7, 50, 133], max_chars=40)
    assert all(len(p) <= 41 for p in phrases[:-1])
    rebuilt = " ".join(phrases).split()
    assert rebuilt == text.split()  # no token was split


def test_flush_and_validation():
    buf = PhraseBuffer()
    assert buf.push("no end yet") == []
    assert buf.flush() == "no end yet"
    assert buf.flush() is None
    with pytest.raises(ValueError, match="max_chars"):
        PhraseBuffer(max_chars=5)
