"""Tiny official Qwen3-TTS checkpoints (custom_voice, base, voice_design) built by `qwen-tts==0.1.1`.

The session-scoped fixture `oracle_checkpoints` builds the three folders once per pytest session
in a tmp dir, in the official layout (config.json, generation_config.json, model.safetensors,
tokenizer files, speech_tokenizer/), following docs/qwen3-tts.md §8.2: toy byte tokenizer,
tiny talker/predictor/speaker-encoder/codec configs, a seeded non-degenerate re-init, the
speaker-encoder config rewrite (Obstacle 2) and Mimi `upsample_groups` = hidden (Obstacle 3).
`load_official(path)` loads one back through the official API (fp32, eager attention).
"""

from __future__ import annotations

import json
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from tilevox.models.qwen3_tts.tokenizer import build_byte_tokenizer

__all__ = ["CHECKPOINT_KINDS", "build_oracle_checkpoints", "load_official", "oracle_checkpoints"]

CHECKPOINT_KINDS = ("custom_voice", "base", "voice_design")

_CODEBOOK_SIZE = 32
_NUM_CODE_GROUPS = 4
TINY_TEXT_VOCAB = 272
TINY_CODEC_IDS = {
    "codec_pad_id": 40,
    "codec_bos_id": 41,
    "codec_eos_token_id": 42,
    "codec_think_id": 43,
    "codec_nothink_id": 44,
    "codec_think_bos_id": 45,
    "codec_think_eos_id": 46,
}
TINY_LANGUAGES = {"english": 52, "chinese": 53, "beijing_dialect": 54}
TINY_SPEAKERS = {"aiden": 62, "dylan": 63}
TINY_DIALECTS = {"aiden": False, "dylan": "beijing_dialect"}
GENERATION_CONFIG = {
    "do_sample": True,
    "top_k": 50,
    "top_p": 1.0,
    "temperature": 0.9,
    "repetition_penalty": 1.05,
    "subtalker_dosample": True,
    "subtalker_top_k": 50,
    "subtalker_top_p": 1.0,
    "subtalker_temperature": 0.9,
    "max_new_tokens": 8192,
}


_TORCHAUDIO_STAND_INS = ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi")


def _torchaudio_unavailable(name: str):
    raise AttributeError(f"torchaudio is a stand-in in the tests (qwen-tts's 25 Hz tokenizer is not tested): {name}")


def _import_qwen_tts():
    """Import qwen_tts (once) with stand-ins for the torchaudio modules it imports.

    `import qwen_tts` imports its 25 Hz tokenizer, which imports `torchaudio.compliance.kaldi`; the
    12 Hz models tested here never call it, and no torchaudio on PyPI loads in torch 2.13 (the newest,
    2.11.1, has C++ extensions built for torch 2.11). So torchaudio is not installed, and for the
    import only, sys.modules holds empty stand-ins whose attributes raise; sys.modules is restored after.
    """
    if "qwen_tts" in sys.modules:
        return sys.modules["qwen_tts"]
    import transformers  # noqa: F401  (first: its import-time probe for torchaudio must not see the stand-ins)

    stand_ins = {name: types.ModuleType(name) for name in _TORCHAUDIO_STAND_INS}
    stand_ins["torchaudio.compliance.kaldi"].__getattr__ = _torchaudio_unavailable
    stand_ins["torchaudio"].compliance = stand_ins["torchaudio.compliance"]
    stand_ins["torchaudio.compliance"].kaldi = stand_ins["torchaudio.compliance.kaldi"]
    saved = {name: sys.modules[name] for name in stand_ins if name in sys.modules}
    sys.modules.update(stand_ins)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import qwen_tts  # (also imports sox and onnxruntime; see docs §8.1)
    finally:
        for name in stand_ins:
            if name in saved:
                sys.modules[name] = saved[name]
            else:
                sys.modules.pop(name, None)
    return qwen_tts


def _speaker_encoder_config(enc_dim: int) -> dict:
    return {
        "mel_dim": 128,
        "enc_dim": enc_dim,
        "enc_channels": [16, 16, 16, 16, 48],
        "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 4, 1],
        "enc_attention_channels": 8,
        "enc_res2net_scale": 8,
        "enc_se_channels": 8,
        "sample_rate": 24000,
    }


def _model_config_dict(kind: str, tokenizer) -> dict:
    hidden = 32
    talker = {
        "vocab_size": _CODEBOOK_SIZE + 1024,  # generate() suppresses the top 1024 ids except EOS
        "hidden_size": hidden,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "interleaved": True},
        "max_position_embeddings": 32768,
        "text_vocab_size": TINY_TEXT_VOCAB,
        "text_hidden_size": 48,
        "num_code_groups": _NUM_CODE_GROUPS,
        "codec_language_id": dict(TINY_LANGUAGES),
        # __init__ iterates spk_id, so Base/VoiceDesign keep the table too (as in the official configs
        # it may be empty there; a non-empty table is harmless because those prompts pass no speaker).
        "spk_id": dict(TINY_SPEAKERS),
        "spk_is_dialect": dict(TINY_DIALECTS),
        **TINY_CODEC_IDS,
        "code_predictor_config": {
            "vocab_size": _CODEBOOK_SIZE,
            "hidden_size": 24,  # != talker hidden, so the 1.7B-style small_to_mtp_projection exists
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 65536,
            "rms_norm_eps": 1e-6,
            "num_code_groups": _NUM_CODE_GROUPS,
        },
    }
    return {
        "talker_config": talker,
        "speaker_encoder_config": _speaker_encoder_config(hidden),
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": "1b7",  # keeps instructions on CustomVoice (the wrapper drops them for 0b6)
        "tts_model_type": kind,
        "im_start_token_id": tokenizer.token_to_id("<|im_start|>"),
        "im_end_token_id": tokenizer.token_to_id("<|im_end|>"),
        "tts_pad_token_id": tokenizer.token_to_id("<tts_pad>"),
        "tts_bos_token_id": tokenizer.token_to_id("<tts_text_bos>"),
        "tts_eos_token_id": tokenizer.token_to_id("<tts_text_eod>"),
        "assistant_token_id": tokenizer.token_to_id("assistant"),
    }


def _speech_tokenizer_config_dict() -> dict:
    encoder = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "intermediate_size": 64,
        "num_filters": 8,
        "upsampling_ratios": [8, 6, 5, 4],
        "codebook_size": _CODEBOOK_SIZE,
        "codebook_dim": 16,
        "vector_quantization_hidden_dimension": 16,
        "num_quantizers": 8,
        "num_semantic_quantizers": 1,
        "upsample_groups": 32,  # Obstacle 3: must divide the hidden size (Mimi default 512)
        "sliding_window": 250,
        "frame_rate": 12.5,
        "use_causal_conv": True,
        "pad_mode": "constant",
        "compress": 2,
    }
    decoder = {
        "codebook_size": _CODEBOOK_SIZE,
        "codebook_dim": 16,
        "latent_dim": 32,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "sliding_window": 72,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000,
        "layer_scale_initial_scale": 0.01,
        "num_quantizers": _NUM_CODE_GROUPS,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 64,
    }
    return {
        "encoder_config": encoder,
        "decoder_config": decoder,
        "encoder_valid_num_quantizers": _NUM_CODE_GROUPS,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "encode_downsample_rate": 1920,
        "decode_upsample_rate": 1920,
    }


@torch.no_grad()
def _reinit(module: torch.nn.Module, seed: int) -> None:
    """Seeded re-init of every saved tensor (HF init leaves RVQ sums at 0, i.e. a silent codec)."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not tensor.is_floating_point():
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "initialized":
            tensor.fill_(1.0)
        elif leaf == "cluster_usage":
            tensor.copy_(torch.rand(tensor.shape, generator=gen) + 0.5)
        elif "norm" in name and leaf == "weight":
            tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=gen))
        else:
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=gen))


def _build_one(kind: str, directory: Path, seed: int) -> None:
    qwen_tts = _import_qwen_tts()
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration, Qwen3TTSProcessor
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model
    from transformers import EncodecFeatureExtractor, Qwen2TokenizerFast

    del qwen_tts
    raw_tok = build_byte_tokenizer()
    hf_tok = Qwen2TokenizerFast(
        tokenizer_object=raw_tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
    )
    config_dict = _model_config_dict(kind, raw_tok)
    config = Qwen3TTSConfig(**config_dict)
    torch.manual_seed(seed)
    model = Qwen3TTSForConditionalGeneration(config).eval()
    _reinit(model, seed)
    model.save_pretrained(directory)
    Qwen3TTSProcessor(tokenizer=hf_tok).save_pretrained(directory)
    hf_tok.save_pretrained(directory)

    # Obstacle 2: the speaker-encoder config class cannot re-read what save_pretrained wrote.
    saved = json.loads((directory / "config.json").read_text())
    saved["speaker_encoder_config"] = config_dict["speaker_encoder_config"]
    (directory / "config.json").write_text(json.dumps(saved, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))

    st_dir = directory / "speech_tokenizer"
    st_config = Qwen3TTSTokenizerV2Config(**_speech_tokenizer_config_dict())
    codec = Qwen3TTSTokenizerV2Model(st_config).eval()
    _reinit(codec, seed + 1)
    codec.save_pretrained(st_dir)
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000).save_pretrained(st_dir)


def build_oracle_checkpoints(root: Path, seed: int = 1234) -> dict[str, Path]:
    """Build the three tiny checkpoints under `root`; returns kind -> folder."""
    paths = {}
    for kind_idx, kind in enumerate(CHECKPOINT_KINDS):
        directory = root / kind
        directory.mkdir(parents=True, exist_ok=True)
        _build_one(kind, directory, seed + 10 * kind_idx)
        paths[kind] = directory
    return paths


def load_official(path: Path):
    """Load a checkpoint folder through the official wrapper exactly like production (fp32, eager)."""
    _import_qwen_tts()
    from qwen_tts import Qwen3TTSModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Qwen3TTSModel.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")


@pytest.fixture(scope="session")
def oracle_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """kind ("custom_voice" | "base" | "voice_design") -> tiny official checkpoint folder."""
    pytest.importorskip("qwen_tts", reason="the official qwen-tts==0.1.1 package is needed for oracle tests")
    return build_oracle_checkpoints(tmp_path_factory.mktemp("qwen3_tts_oracle"))
