"""The Qwen3-TTS talker: a Qwen3 decoder over summed text-track + codec-track embeddings that
predicts codebook 0 of the next audio frame, and owns the code predictor.

Module names mirror the checkpoint (`talker.model.layers.*`, `talker.text_projection.*`,
`talker.codec_head`, `talker.code_predictor.*`) so weights load by name. Streams live in slots
of one `KVCache`; `forward_tokens` runs any batch of rows at their own positions.
Imports: torch, models.qwen3_tts.{config,layers,code_predictor}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tilevox.models.decoder_view import DecoderView, ModelFamily
from tilevox.models.qwen3_tts.code_predictor import CodePredictor
from tilevox.models.qwen3_tts.config import TalkerConfig
from tilevox.models.qwen3_tts.layers import CacheView, DecoderStack, KVCache

__all__ = ["Talker", "TalkerBackbone", "TextProjection"]


class TalkerBackbone(DecoderStack):
    """`talker.model`: decoder layers, final norm, codec and text embedding tables."""

    def __init__(self, config: TalkerConfig):
        super().__init__(config.transformer)
        self.codec_embedding = nn.Embedding(config.vocab_size, config.transformer.hidden_size)
        self.text_embedding = nn.Embedding(config.text_vocab_size, config.text_hidden_size)


class TextProjection(nn.Module):
    """text_hidden -> text_hidden -> talker hidden, SiLU between, with biases."""

    def __init__(self, config: TalkerConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.text_hidden_size, config.text_hidden_size)
        self.linear_fc2 = nn.Linear(config.text_hidden_size, config.transformer.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    def __init__(self, config: TalkerConfig):
        super().__init__()
        self.config = config
        self.model = TalkerBackbone(config)
        self.text_projection = TextProjection(config)
        self.codec_head = nn.Linear(config.transformer.hidden_size, config.vocab_size, bias=False)
        self.code_predictor = CodePredictor(config)

    def decoder_view(self) -> DecoderView:
        """The weights a region compiler reads (models.decoder_view): layers, final norm, codec head."""
        c = self.config.transformer
        return DecoderView(
            family=ModelFamily.QWEN3_TTS_TALKER,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            inv_freq=self.model.region_inv_freq(),
            layers=self.model.layer_weights(),
            final_norm=self.model.norm.weight,
            embed_tables=(),
            heads=(self.codec_head.weight,),
            projection=None,
            input_size=c.hidden_size,
        )

    def new_cache(self, *, num_slots: int, max_len: int) -> KVCache:
        param = self.codec_head.weight
        return KVCache(
            self.config.transformer, num_slots=num_slots, max_len=max_len, device=param.device, dtype=param.dtype
        )

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """Text-track embedding T(ids): (...,) long -> (..., H)."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec-track embedding C(ids): (...,) long -> (..., H)."""
        return self.model.codec_embedding(ids)

    def embed_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """All Q codes of frames (..., Q) -> (..., H): codebook 0 through the talker table, codebook
        i >= 1 through predictor table i-1, summed (the talker input of the next position)."""
        parts = [self.embed_codec(codes[..., 0])]
        parts += [self.code_predictor.embed_code(i - 1, codes[..., i]) for i in range(1, codes.shape[-1])]
        return torch.stack(parts, dim=-2).sum(-2)

    def forward_tokens(self, inputs: torch.Tensor, view: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs (B, T, H) at each row's cache position -> (last hidden (B, H), codec logits (B, vocab))."""
        hidden = self.model.run_layers(inputs, view)[:, -1]  # (B, H) after the final norm
        return hidden, self.codec_head(hidden)

    def forward_layers(self, x: torch.Tensor, view: CacheView, first: int = 0, stop: int | None = None) -> torch.Tensor:
        """A piece of forward_tokens cut at layer boundaries: the residual stream x (B, T, H) through layers
        [first, stop), no final norm (executor.split)."""
        return self.model.run_layers(x, view, first, stop, final_norm=False)

    def head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream (B, H) after the last layer -> (hidden after the final norm, codec logits), as
        forward_tokens returns them."""
        hidden = self.model.norm(x)
        return hidden, self.codec_head(hidden)

    def forward_prompts(
        self, inputs: torch.Tensor, view: CacheView, last: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded prompts inputs (B, T, H) from position 0 -> (hidden (B, H), codec logits (B, vocab))
        at each row's last prompt position `last` (B,) long."""
        hidden = self.model.run_layers(inputs, view)  # (B, T, H) after the final norm
        hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return hidden, self.codec_head(hidden)
