"""Conventional (plain PyTorch) decode paths and byte counts that the megakernel scripts compare against.

`ConventionalLlamaStep` is one greedy LlamaForCausalLM decode step over static device tensors (tokens,
positions, slots; a static key count), so it can be captured in a CUDA graph or compiled with
torch.compile(mode="reduce-overhead"). `ConventionalQwenFrame` is one Qwen3-TTS frame (code predictor,
frame embedding, talker step) the same way. The byte counts are what a step must read from memory.
Imports: torch, models (used by benchmarks/megakernel_correctness.py and benchmarks/megakernel_h200.py).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence

import torch

from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.model import LlamaForCausalLM, LlamaKVCache
from tilevox.models.llama.weights import o1_random_llama
from tilevox.models.llasa.loader import llama_config
from tilevox.models.llasa.presets import LLASA_PRESETS
from tilevox.models.qwen3_tts.config import Qwen3TTSConfig
from tilevox.models.qwen3_tts.layers import CacheView
from tilevox.models.qwen3_tts.loader import preset_config_dict, randomize_network_
from tilevox.models.qwen3_tts.talker import Talker

__all__ = [
    "LLAMA_VARIANTS",
    "ConventionalLlamaStep",
    "ConventionalQwenFrame",
    "fp32_twin",
    "llama_step_bytes",
    "o1_random_llama",
    "qwen_frame_bytes",
    "random_talker",
]

# Llama networks by name: every Llasa preset of models.registry under its own name (llama-1b is Llasa-1B's
# network, as in synth and serve), plus two shapes that are not served presets, kept for comparison with
# published megakernel figures: Llama-3.2-1B itself (128,256-token vocabulary, head tied to the embedding
# table) and the tiny network with a tied head.
LLAMA_VARIANTS: dict[str, LlamaConfig] = {name: llama_config(name) for name in LLASA_PRESETS}
LLAMA_VARIANTS["llama-3.2-1b"] = dataclasses.replace(
    LLAMA_VARIANTS["llama-1b"], vocab_size=128256, tie_word_embeddings=True
)
LLAMA_VARIANTS["llama-tiny-tied"] = dataclasses.replace(LLAMA_VARIANTS["llama-tiny"], tie_word_embeddings=True)


@torch.no_grad()
def fp32_twin(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """An fp32 copy holding exactly the model's (bf16) weight values; ties survive the deepcopy."""
    return copy.deepcopy(model).float()


class ConventionalLlamaStep:
    """One greedy decode step of `model` on static device tensors (CUDA-graph capturable):
    logits = lm_head(forward(tokens, positions)); tokens <- argmax; positions += 1.

    Attention reads a static `num_keys` keys per row, masked to each row's own position."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: LlamaKVCache,
        slots: Sequence[int],
        positions: Sequence[int],
        *,
        num_keys: int,
    ) -> None:
        if len(slots) != len(positions) or not slots:
            raise ValueError(f"need one position per slot, got {len(slots)} slots and {len(positions)} positions")
        if max(positions) >= num_keys or num_keys > cache.max_seq_len:
            raise ValueError(
                f"positions up to {max(positions)} need num_keys > them and <= the cache's "
                f"{cache.max_seq_len} positions, got num_keys {num_keys}"
            )
        device = model.device
        self.model = model
        self.cache = cache
        self.num_keys = num_keys
        self.slots = torch.tensor(list(slots), dtype=torch.int64, device=device)
        self.start = torch.tensor(list(positions), dtype=torch.int64, device=device)
        self.positions = self.start.clone()
        self.tokens = torch.zeros(len(slots), dtype=torch.int64, device=device)

    def logits(self) -> torch.Tensor:
        """(B, vocab) logits at the current tokens and positions; writes this step's K/V, advances nothing."""
        hidden = self.model.forward(
            self.tokens[:, None], self.cache, self.slots, self.positions[:, None], self.num_keys
        )
        return self.model.lm_head(hidden[:, 0])

    def __call__(self) -> None:
        self.tokens.copy_(self.logits().argmax(-1))
        self.positions.add_(1)

    def reset(self) -> None:
        """Back to the start positions (a device copy: capturable and cheap to run before a timing)."""
        self.positions.copy_(self.start)

    def mark_static(self) -> None:
        """For torch.compile(mode="reduce-overhead"): the cache and the step's tensors keep their
        addresses, so CUDA-graph trees may mutate them in place instead of skipping the graph."""
        for tensor in (self.cache.k, self.cache.v, self.slots, self.positions, self.tokens):
            torch._dynamo.mark_static_address(tensor)


def random_talker(preset: str, *, seed: int, device, dtype: torch.dtype) -> Talker:
    """The Qwen3-TTS talker (with its code predictor) of `preset`, seeded random weights
    (models.qwen3_tts.loader.randomize_network_), built on the meta device and materialized on `device`."""
    config = Qwen3TTSConfig.from_dict(preset_config_dict(preset))
    with torch.device("meta"):
        talker = Talker(config.talker)
    talker = talker.to_empty(device=torch.device(device)).to(dtype)
    randomize_network_(talker, seed)
    return talker.eval().requires_grad_(False)


class ConventionalQwenFrame:
    """One audio frame for B streams with static buffers, as Qwen3TTSSpeechModel.step computes it
    with greedy choices: codes 1..Q-1 from the code predictor, the frame embedding (+ a text-track row),
    then a talker step at `context` cached tokens whose argmax is the next frame's codebook 0.

    Each call reuses the same talker position (the timing repeats one frame; nothing advances)."""

    def __init__(self, talker: Talker, *, batch: int, context: int, cache_len: int, seed: int) -> None:
        if not 0 <= context < cache_len:
            raise ValueError(f"context must be in [0, cache_len={cache_len}), got {context}")
        device, dtype = talker.codec_head.weight.device, talker.codec_head.weight.dtype
        hidden_size = talker.config.transformer.hidden_size
        gen = torch.Generator(device=device).manual_seed(seed)
        self.talker = talker
        self.predictor = talker.code_predictor
        self.cache = talker.new_cache(num_slots=batch, max_len=cache_len)
        self.cache.keys.normal_(generator=gen)
        self.cache.values.normal_(generator=gen)
        self.predictor_cache = self.predictor.new_cache(batch)
        self.hidden = torch.randn(batch, hidden_size, generator=gen, device=device).to(dtype)
        self.text_row = torch.randn(batch, hidden_size, generator=gen, device=device).to(dtype)
        self.code0 = torch.randint(0, talker.config.num_audio_codes, (batch,), generator=gen, device=device)
        self.start = torch.full((batch,), context, dtype=torch.int64, device=device)
        self.view = CacheView(cache=self.cache, slots=slice(0, batch), start=self.start, kv_len=context + 1)
        self.codes = torch.zeros(batch, talker.config.num_code_groups, dtype=torch.int64, device=device)

    def __call__(self) -> None:
        rest = self.predictor.predict(
            self.hidden,
            self.talker.embed_codec(self.code0),
            lambda head, logits: logits.argmax(-1),
            self.predictor_cache,
        )  # (B, Q-1)
        frames = torch.cat((self.code0[:, None], rest), dim=1)  # (B, Q)
        inputs = self.talker.embed_frame(frames) + self.text_row  # (B, H)
        hidden, logits = self.talker.forward_tokens(inputs[:, None], self.view)
        self.codes.copy_(frames)
        self.hidden.copy_(hidden)
        self.code0.copy_(logits.argmax(-1))

    def mark_static(self) -> None:
        """See ConventionalLlamaStep.mark_static."""
        for tensor in (
            self.cache.keys,
            self.cache.values,
            self.predictor_cache.keys,
            self.predictor_cache.values,
            self.hidden,
            self.text_row,
            self.code0,
            self.start,
            self.codes,
        ):
            torch._dynamo.mark_static_address(tensor)


def _nbytes(shape: Sequence[int], element_size: int) -> int:
    return math.prod(shape) * element_size


def llama_step_bytes(config: LlamaConfig, keys_per_row: Sequence[int], element_size: int) -> dict[str, int]:
    """Bytes one decode step reads: every layer matrix and norm, the final norm and the head once, one
    embedding row per stream (not the table), and each row's K and V over `keys_per_row[b]` keys
    (its context plus the new token). A tied head counts once (as the head)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.resolved_head_dim
    q_rows, kv_rows = config.num_attention_heads * d, config.num_key_value_heads * d
    per_layer = (q_rows * h + 2 * kv_rows * h + h * q_rows + 3 * i * h + 2 * h) * element_size
    weights = config.num_hidden_layers * per_layer + h * element_size + _nbytes((config.vocab_size, h), element_size)
    embed_rows = len(keys_per_row) * h * element_size
    kv = sum(keys_per_row) * config.num_hidden_layers * 2 * kv_rows * element_size
    return {
        "weight_bytes": weights,
        "embedding_row_bytes": embed_rows,
        "kv_bytes": kv,
        "total_bytes": weights + embed_rows + kv,
    }


def qwen_frame_bytes(talker: Talker, *, batch: int, context: int, element_size: int) -> dict[str, int]:
    """Bytes one frame reads: the talker's layers, final norm and codec head once, with K/V over
    context + 1 keys per stream; the predictor's layers and final norm once per head (Q-1 sequential
    passes: a 2-token first pass, then one token each), each head once, the K/V of its <= Q positions;
    one embedding row per code per stream (frame embedding and predictor inputs)."""

    def stack_bytes(c) -> tuple[int, int]:
        h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
        q_rows, kv_rows = c.num_heads * d, c.num_kv_heads * d
        per_layer = q_rows * h + 2 * kv_rows * h + h * q_rows + 3 * i * h + 2 * h + 2 * d
        return (c.num_layers * per_layer + h) * element_size, c.num_layers * 2 * kv_rows * element_size

    tc, pc = talker.config.transformer, talker.config.code_predictor.transformer
    talker_weights, talker_kv_per_key = stack_bytes(tc)
    talker_weights += talker.codec_head.weight.numel() * element_size
    pred_pass, pred_kv_per_key = stack_bytes(pc)
    num_heads = talker.config.num_code_groups - 1
    pred_weights = (
        num_heads * pred_pass + sum(head.weight.numel() for head in talker.code_predictor.lm_head) * element_size
    )
    proj = talker.code_predictor.small_to_mtp_projection
    if proj is not None:
        pred_weights += num_heads * (proj.weight.numel() + proj.bias.numel()) * element_size
    # Pass j (0-based) attends j + 2 keys (positions 0..j+1).
    pred_keys = sum(j + 2 for j in range(num_heads))
    kv = batch * ((context + 1) * talker_kv_per_key + pred_keys * pred_kv_per_key)
    embed_rows = batch * 2 * talker.config.num_code_groups * tc.hidden_size * element_size
    weights = talker_weights + pred_weights
    return {
        "weight_bytes": weights,
        "talker_weight_bytes": talker_weights,
        "predictor_weight_bytes": pred_weights,
        "embedding_row_bytes": embed_rows,
        "kv_bytes": kv,
        "total_bytes": weights + embed_rows + kv,
    }
