"""Qwen3-TTS (12 Hz; 0.6B and 1.7B; CustomVoice, VoiceDesign, Base): talker, code predictor,
dual-track prompts and the streaming SpeechModel. The speech tokenizer (codec) lives in
`speech_tokenizer/`, the ECAPA-TDNN speaker encoder in `speaker_encoder.py`.
"""

from tilevox.models.qwen3_tts.config import Qwen3TTSConfig, TtsModelType
from tilevox.models.qwen3_tts.loader import load_checkpoint, load_preset
from tilevox.models.qwen3_tts.model import ModelOptions, Qwen3TTSSpeechModel

__all__ = ["ModelOptions", "Qwen3TTSConfig", "Qwen3TTSSpeechModel", "TtsModelType", "load_checkpoint", "load_preset"]
