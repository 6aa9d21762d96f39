"""Voice and model names that clients send, mapped onto the served model's voices.

OpenAI clients (Pipecat refuses anything else) send one of OpenAI's 13 built-in voice names. The
i-th name in `OPENAI_VOICES` maps to the served model's voice number (i mod N), where N is the
number of voices the model lists; a model with no named voices serves its default voice for all
13. The model's own voice names are accepted as well, and take precedence. OpenAI model names
(tts-1, tts-1-hd, gpt-4o-mini-tts) and "tilevox" are aliases of the one served model.
"""

from __future__ import annotations

from dataclasses import dataclass

from tilevox.models.streaming import SpeechModel

__all__ = ["OPENAI_MODELS", "OPENAI_VOICES", "VoiceCatalog"]

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse", "marin", "cedar")
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "tilevox")


@dataclass(frozen=True, slots=True)
class VoiceCatalog:
    model_id: str
    model_voices: tuple[str, ...]  # empty: the model has only its default voice
    languages: tuple[str, ...]

    @classmethod
    def for_model(cls, model: SpeechModel) -> VoiceCatalog:
        infos = model.voices()
        langs = sorted({lang for v in infos for lang in v.languages})
        return cls(model_id=model.model_id, model_voices=tuple(v.name for v in infos), languages=tuple(langs))

    def resolve_voice(self, name: str | None) -> str | None:
        """Client voice name -> the model voice name (None = model default). Raises ValueError."""
        if name is None or name == "" or name == "default":
            return None
        if name in self.model_voices:
            return name
        lowered = name.lower()
        if lowered in OPENAI_VOICES:
            if not self.model_voices:
                return None
            return self.model_voices[OPENAI_VOICES.index(lowered) % len(self.model_voices)]
        known = ", ".join(self.model_voices + OPENAI_VOICES)
        raise ValueError(f"unknown voice {name!r}; known voices: {known}")

    def is_served_model(self, name: str | None) -> bool:
        return name is None or name == self.model_id or name in OPENAI_MODELS

    def mapping(self) -> dict[str, str]:
        """OpenAI name -> model voice (for /v1/audio/voices and the docs)."""
        return {v: (self.resolve_voice(v) or "default") for v in OPENAI_VOICES}

    def listed(self) -> list[dict]:
        own = [{"id": v, "name": v, "kind": "model"} for v in (self.model_voices or ("default",))]
        aliases = [{"id": v, "name": v, "kind": "openai_alias", "maps_to": m} for v, m in self.mapping().items()]
        return own + aliases
