"""The flat weight view through which a model hands a decoder network to a region compiler.

Each decoder network that a region can run (models.llama's LlamaForCausalLM, models.qwen3_tts' Talker
and CodePredictor, models.nh_tts' NhTtsNetwork) implements `decoder_view()`, returning a `DecoderView`: per-layer weights named by
role (the tensors themselves, no copies), RoPE inverse frequencies computed exactly as the network
computes them, and its embedding tables and heads. The compiler reads this view and never the
network's own attributes; `decoder_view(module)` asks a module for its view. Imports: torch only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "CrossAttentionShape",
    "CrossAttentionWeights",
    "DecoderView",
    "LayerWeights",
    "ModelFamily",
    "decoder_view",
    "layer_weights_of",
]


class ModelFamily(enum.Enum):
    """How a region's inputs and outputs attach to the layers (the compiler's only model distinction)."""

    LLAMA = "llama"  # token in (one embedding table), logits out (one head)
    QWEN3_TTS_TALKER = "qwen3_tts_talker"  # summed embeddings in, final-norm hidden and codec logits out
    QWEN3_TTS_CODE_PREDICTOR = "qwen3_tts_code_predictor"  # Q-1 heads, each code embedded for the next
    # Summed codebook embeddings in (computed by the caller), every channel's logits out of one head of
    # channels x vocab rows, cross-attention over per-row encoder keys/values in each layer; no on-device
    # sampling (guidance and the delay pattern pick on the host).
    NH_TTS = "nh_tts"
    # A codec's decoder transformer (the Qwen3-TTS speech tokenizer's): a hidden state in through the input
    # `projection` (with bias), layers with sliding-window attention and layer scales, final norm and the
    # `output_projection` (with bias) out; no embeddings, heads or sampling.
    QWEN3_TTS_CODEC = "qwen3_tts_codec"


@dataclass(frozen=True, slots=True, kw_only=True)
class CrossAttentionWeights:
    """One layer's cross-attention, between self-attention and the MLP: x += w_o . attend(w_q . norm(x) * ln,
    the row's encoder keys/values). Keys and values are computed once per stream, outside the region."""

    ln: torch.Tensor  # (hidden,) the pre-cross-attention norm
    w_q: torch.Tensor  # (Hc * Dc, hidden), no RoPE
    w_o: torch.Tensor  # (hidden, Hc * Dc)


@dataclass(frozen=True, slots=True, kw_only=True)
class CrossAttentionShape:
    """Heads of the cross-attention (it may differ from the self-attention's) and the longest text a
    row's encoder keys/values may hold by default (the region's cross cache length when none is given)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_text_len: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerWeights:
    ln1: torch.Tensor  # (hidden,)
    w_q: torch.Tensor  # (H * D, hidden)
    w_k: torch.Tensor  # (Hkv * D, hidden)
    w_v: torch.Tensor  # (Hkv * D, hidden)
    qk_norm: torch.Tensor | None  # (2, D): rows q_norm, k_norm (Qwen3) or None (Llama)
    w_o: torch.Tensor  # (hidden, H * D)
    ln2: torch.Tensor  # (hidden,)
    w_gate: torch.Tensor  # (I, hidden)
    w_up: torch.Tensor  # (I, hidden)
    w_down: torch.Tensor  # (hidden, I)
    cross: CrossAttentionWeights | None = None  # NH_TTS: every layer has one; others: None
    # Layer scales (QWEN3_TTS_CODEC): x += attn_layer_scale * attention, x += mlp_layer_scale * mlp; None: none.
    attn_layer_scale: torch.Tensor | None = None  # (hidden,)
    mlp_layer_scale: torch.Tensor | None = None  # (hidden,)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderView:
    family: ModelFamily
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    inv_freq: torch.Tensor  # (D/2,) fp32
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # (hidden,)
    # LLAMA: one table and one head. TALKER: no input table (inputs are summed embeddings), codec head.
    # CODE_PREDICTOR: Q-1 tables and Q-1 heads (head j, then table j embeds its code), an optional
    # input projection talker width -> predictor width.
    embed_tables: tuple[torch.Tensor, ...]
    heads: tuple[torch.Tensor, ...]
    projection: tuple[torch.Tensor, torch.Tensor] | None  # (weight (Hp, Ht), bias (Hp,))
    input_size: int  # width of the embeddings / hidden fed to the region (talker width for the predictor)
    attn_scale: float | None = None  # attention logit scale; None: head_dim ** -0.5 (Dia folds it in: 1)
    cross: CrossAttentionShape | None = None  # NH_TTS: the layers' cross-attention heads; others: None
    sliding_window: int | None = None  # keys a query attends, itself included (QWEN3_TTS_CODEC); None: all
    output_projection: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight (out, hidden), bias (out,))

    @property
    def dtype(self) -> torch.dtype:
        return self.final_norm.dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def layer_weights_of(layer: torch.nn.Module, **extra: torch.Tensor | None) -> LayerWeights:
    """The LayerWeights of a decoder layer in the common (Llama / Qwen3 / the Qwen3-TTS codec) module layout:
    input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj; `extra`
    sets the other fields (qk_norm, layer scales), None by default. No copies."""
    attn, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        ln1=layer.input_layernorm.weight,
        w_q=attn.q_proj.weight,
        w_k=attn.k_proj.weight,
        w_v=attn.v_proj.weight,
        w_o=attn.o_proj.weight,
        ln2=layer.post_attention_layernorm.weight,
        w_gate=mlp.gate_proj.weight,
        w_up=mlp.up_proj.weight,
        w_down=mlp.down_proj.weight,
        **{"qk_norm": None, **extra},
    )


def decoder_view(module: torch.nn.Module) -> DecoderView:
    """`module.decoder_view()`; TypeError for a module that declares no decoder view."""
    declare = getattr(module, "decoder_view", None)
    if declare is None:
        raise TypeError(
            f"{type(module).__name__} declares no decoder view (a region runs networks that implement "
            "decoder_view(), see models.decoder_view)"
        )
    view = declare()
    if not isinstance(view, DecoderView):
        raise TypeError(f"{type(module).__name__}.decoder_view() returned {type(view).__name__}, not a DecoderView")
    return view
