"""Voice and model names that clients send, mapped onto the served model's voices.

One resolver for every surface (`VoiceCatalog.resolve_voice`):
- the model's own voice names, exact or case-insensitive, take precedence;
- OpenAI's 13 built-in voice names (OpenAI clients, and frameworks such as Pipecat, send nothing else):
  the i-th name in `OPENAI_VOICES` maps to the served model's voice number (i mod N), N = the voices the
  model lists; a model with no named voices serves its default voice for all 13;
- NVIDIA's hosted catalog voices, bare (`Aria`) or as catalog names `<Model>.<LANG>.<Voice>[.<Style>]`
  (`Magpie-Multilingual.EN-US.Aria`, the default voices of the frameworks' Riva/NVIDIA services): the
  voice part is matched like any other name (another model's prefix is ignored), and `NVIDIA_VOICES`
  map the same way as OpenAI's names, with one warning per name saying which voice serves it;
- `lenient=True` (the Riva surface unless `--strict-voices`): a name that matches nothing is served by the
  model's default voice, with one warning per name for the life of the process.
OpenAI model names (tts-1, tts-1-hd, gpt-4o-mini-tts) and "tilevox" are aliases of the one served model.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from tilevox.models.streaming import SpeechModel
from tilevox.server.logs import log_event

__all__ = ["NVIDIA_VOICES", "OPENAI_MODELS", "OPENAI_VOICES", "VoiceCatalog", "voice_part"]

log = logging.getLogger("tilevox.voices")

OPENAI_VOICES = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "onyx",
    "nova",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)
# English (EN-US) voices of NVIDIA's hosted Magpie-Multilingual catalog, the frameworks' defaults among them
NVIDIA_VOICES = ("aria", "diego", "isabela", "jason", "leo", "louise", "mia", "pascal", "ray", "sofia")
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "tilevox")


def voice_part(name: str) -> str:
    """`Magpie-Multilingual.EN-US.Aria` -> `Aria`, `Tilevox.EN-US.anna.Calm` -> `anna`; other names unchanged.
    A catalog name is `<Model>.<LANG>.<Voice>[.<Style>]`, LANG a BCP-47 tag such as EN-US."""
    parts = name.split(".")
    if len(parts) >= 3 and "-" in parts[1] and parts[1].replace("-", "").isalpha():
        return parts[2]
    return name


@dataclass(frozen=True, slots=True)
class VoiceCatalog:
    model_id: str
    model_voices: tuple[str, ...]  # empty: the model has only its default voice
    languages: tuple[str, ...]
    _warned: set = field(default_factory=set, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @classmethod
    def for_model(cls, model: SpeechModel) -> VoiceCatalog:
        infos = model.voices()
        langs = sorted({lang for v in infos for lang in v.languages})
        return cls(model_id=model.model_id, model_voices=tuple(v.name for v in infos), languages=tuple(langs))

    def _alias(self, table: tuple[str, ...], lowered: str) -> str | None:
        if not self.model_voices:
            return None
        return self.model_voices[table.index(lowered) % len(self.model_voices)]

    def resolve_voice(self, name: str | None, *, lenient: bool = False) -> str | None:
        """Client voice name -> the model voice name (None = the model's default). Raises ValueError for a
        name that matches nothing, unless `lenient` (then the default voice, with one warning per name)."""
        if name is None or name == "" or name == "default":
            return None
        if name in self.model_voices:
            return name
        wanted = voice_part(name)
        lowered = wanted.lower()
        own = {v.lower(): v for v in self.model_voices}
        if lowered in own:
            return own[lowered]
        if lowered in OPENAI_VOICES:
            return self._alias(OPENAI_VOICES, lowered)
        if lowered in NVIDIA_VOICES:  # another catalog's voice: served, and said once
            served = self._alias(NVIDIA_VOICES, lowered)
            self._warn_once(name, "voice.catalog_name_mapped", served=served or "default")
            return served
        if lenient:
            self._warn_once(
                name, "voice.unknown_served_default", served="default", hint="--strict-voices refuses unknown voices"
            )
            return None
        known = ", ".join(self.model_voices + OPENAI_VOICES)
        raise ValueError(
            f"unknown voice {name!r}; known voices: {known} (and NVIDIA catalog names such as Magpie-Multilingual.EN-US.Aria)"
        )

    def _warn_once(self, name: str, event: str, **fields) -> None:
        """One warning per client voice name for the life of the process (not one per request)."""
        with self._lock:
            first = name not in self._warned
            self._warned.add(name)
        if first:
            log_event(log, event, level=logging.WARNING, voice=name, model=self.model_id, **fields)

    def is_served_model(self, name: str | None) -> bool:
        return name is None or name == self.model_id or name in OPENAI_MODELS

    def mapping(self) -> dict[str, str]:
        """OpenAI name -> model voice (for /v1/audio/voices and the docs)."""
        return {v: (self.resolve_voice(v) or "default") for v in OPENAI_VOICES}

    def nvidia_mapping(self) -> dict[str, str]:
        """NVIDIA catalog voice name -> model voice."""
        return {v.capitalize(): (self.resolve_voice(v) or "default") for v in NVIDIA_VOICES}

    def listed(self) -> list[dict]:
        own = [{"id": v, "name": v, "kind": "model"} for v in (self.model_voices or ("default",))]
        aliases = [{"id": v, "name": v, "kind": "openai_alias", "maps_to": m} for v, m in self.mapping().items()]
        nvidia = [
            {"id": f"Magpie-Multilingual.EN-US.{v}", "name": v, "kind": "nvidia_alias", "maps_to": m}
            for v, m in self.nvidia_mapping().items()
        ]
        return own + aliases + nvidia
