"""NH-TTS text ids as transformers' DiaTokenizer makes them: UTF-8 bytes as ids 0-255, except the added
tokens `<pad>` (0), `[S1]` (1) and `[S2]` (2), which are matched as whole strings first (so the bytes
0x01 / 0x02 and the tags share ids, as in Dia's own code). Speaker tags mark who speaks in a dialogue:
`[S1] Hi. [S2] Hello.`. Imports: stdlib only.
"""

from __future__ import annotations

import re

__all__ = ["PAD_ID", "SPEAKER_TAGS", "encode_text", "has_speaker_tag"]

PAD_ID = 0
SPEAKER_TAGS = {"[S1]": 1, "[S2]": 2}
_ADDED = {"<pad>": PAD_ID, **SPEAKER_TAGS}
_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in _ADDED) + ")")


def encode_text(text: str) -> list[int]:
    """Byte-level ids of `text` (DiaTokenizer(text, add_special_tokens=False).input_ids)."""
    ids: list[int] = []
    for piece in _SPLIT.split(text):
        if piece in _ADDED:
            ids.append(_ADDED[piece])
        elif piece:
            ids.extend(piece.encode("utf-8"))
    return ids


def has_speaker_tag(text: str) -> bool:
    return any(tag in text for tag in SPEAKER_TAGS)
