"""Read a reference model into the flat weight view the region compiler needs (no copies of matrices).

`decoder_view` accepts models.llama's LlamaForCausalLM, or models.qwen3_tts' Talker or CodePredictor,
and returns a `DecoderView`: per-layer weights named by role, rotary inverse frequencies computed
exactly as the model computes them, and the model's embedding tables and heads.
Imports: torch, models.llama, models.qwen3_tts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from tilevox.models.llama.model import LlamaForCausalLM, rope_inv_freq
from tilevox.models.qwen3_tts.code_predictor import CodePredictor
from tilevox.models.qwen3_tts.layers import rope_inv_freq as qwen_rope_inv_freq
from tilevox.models.qwen3_tts.talker import Talker

__all__ = ["DecoderView", "LayerWeights", "ModelFamily", "decoder_view"]


class ModelFamily(enum.Enum):
    LLAMA = "llama"
    QWEN3_TTS_TALKER = "qwen3_tts_talker"
    QWEN3_TTS_CODE_PREDICTOR = "qwen3_tts_code_predictor"


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

    @property
    def dtype(self) -> torch.dtype:
        return self.final_norm.dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _qwen_inv_freq(config) -> torch.Tensor:
    """The stack's RoPE frequencies as the PyTorch model computes them (rope_scaling included). The
    megakernel applies no attention scaling to cos/sin, so a scaling that needs one (yarn) is refused."""
    inv_freq, attention_scaling = qwen_rope_inv_freq(config)
    if attention_scaling != 1.0:
        raise ValueError(
            f"rope_scaling {config.rope_scaling.rope_type!r} scales cos/sin by {attention_scaling:.4f}; "
            "the megakernel's RoPE has no such factor"
        )
    return inv_freq


def _qwen_layers(stack) -> tuple[LayerWeights, ...]:
    out = []
    for layer in stack.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out.append(
            LayerWeights(
                ln1=layer.input_layernorm.weight,
                w_q=attn.q_proj.weight,
                w_k=attn.k_proj.weight,
                w_v=attn.v_proj.weight,
                qk_norm=torch.stack((attn.q_norm.weight, attn.k_norm.weight)).detach(),
                w_o=attn.o_proj.weight,
                ln2=layer.post_attention_layernorm.weight,
                w_gate=mlp.gate_proj.weight,
                w_up=mlp.up_proj.weight,
                w_down=mlp.down_proj.weight,
            )
        )
    return tuple(out)


def decoder_view(model: torch.nn.Module) -> DecoderView:
    """The compiler's view of `model`; raises TypeError for anything else."""
    if isinstance(model, LlamaForCausalLM):
        c = model.config
        layers = tuple(
            LayerWeights(
                ln1=layer.input_layernorm.weight,
                w_q=layer.self_attn.q_proj.weight,
                w_k=layer.self_attn.k_proj.weight,
                w_v=layer.self_attn.v_proj.weight,
                qk_norm=None,
                w_o=layer.self_attn.o_proj.weight,
                ln2=layer.post_attention_layernorm.weight,
                w_gate=layer.mlp.gate_proj.weight,
                w_up=layer.mlp.up_proj.weight,
                w_down=layer.mlp.down_proj.weight,
            )
            for layer in model.model.layers
        )
        if c.attention_bias or c.mlp_bias:
            raise ValueError("Llama regions do not support attention_bias / mlp_bias")
        return DecoderView(
            family=ModelFamily.LLAMA,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.resolved_head_dim,
            rms_norm_eps=c.rms_norm_eps,
            inv_freq=rope_inv_freq(c),
            layers=layers,
            final_norm=model.model.norm.weight,
            embed_tables=(model.model.embed_tokens.weight,),
            heads=(model.lm_head.weight,),
            projection=None,
            input_size=c.hidden_size,
        )
    if isinstance(model, Talker):
        c = model.config.transformer
        return DecoderView(
            family=ModelFamily.QWEN3_TTS_TALKER,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            inv_freq=_qwen_inv_freq(c),
            layers=_qwen_layers(model.model),
            final_norm=model.model.norm.weight,
            embed_tables=(),
            heads=(model.codec_head.weight,),
            projection=None,
            input_size=c.hidden_size,
        )
    if isinstance(model, CodePredictor):
        c = model.config.code_predictor.transformer
        proj = model.small_to_mtp_projection
        return DecoderView(
            family=ModelFamily.QWEN3_TTS_CODE_PREDICTOR,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            inv_freq=_qwen_inv_freq(c),
            layers=_qwen_layers(model.model),
            final_norm=model.model.norm.weight,
            embed_tables=tuple(t.weight for t in model.model.codec_embedding),
            heads=tuple(h.weight for h in model.lm_head),
            projection=None if proj is None else (proj.weight, proj.bias),
            input_size=model.config.transformer.hidden_size,
        )
    raise TypeError(f"no region adapter for {type(model).__name__}; expected LlamaForCausalLM, Talker or CodePredictor")
