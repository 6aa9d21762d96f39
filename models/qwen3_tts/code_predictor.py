"""The Qwen3-TTS code predictor ("sub-talker"): codebooks 1..Q-1 of one frame, batched over streams.

Per frame it starts from an empty cache: [talker hidden state, embedding of codebook 0] is a
two-token prefill whose last position feeds head 0, then each sampled code j is embedded with
table j-1 and fed alone to get head j. The 1.7B maps talker width to predictor width with
`small_to_mtp_projection` (a Linear with bias); when widths match there is no projection.
Imports: torch, models.qwen3_tts.{config,layers}.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tilevox.models.decoder_view import DecoderView, ModelFamily
from tilevox.models.qwen3_tts.config import TalkerConfig
from tilevox.models.qwen3_tts.layers import CacheView, DecoderStack, KVCache

__all__ = ["CodePredictor", "CodePredictorBackbone"]


class CodePredictorBackbone(DecoderStack):
    """`code_predictor.model`: the decoder layers plus Q-1 codec embeddings in talker width."""

    def __init__(self, config: TalkerConfig):
        super().__init__(config.code_predictor.transformer)
        num_tables = config.code_predictor.num_code_groups - 1
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(config.code_predictor.vocab_size, config.transformer.hidden_size) for _ in range(num_tables)
        )


class CodePredictor(nn.Module):
    def __init__(self, config: TalkerConfig):
        super().__init__()
        self.config = config
        pc = config.code_predictor
        self.model = CodePredictorBackbone(config)
        self.lm_head = nn.ModuleList(
            nn.Linear(pc.transformer.hidden_size, pc.vocab_size, bias=False) for _ in range(pc.num_code_groups - 1)
        )
        if config.has_projection:
            self.small_to_mtp_projection = nn.Linear(config.transformer.hidden_size, pc.transformer.hidden_size)
        else:
            self.small_to_mtp_projection = None

    def decoder_view(self) -> DecoderView:
        """The weights a region compiler reads (models.decoder_view): layers, Q-1 tables and heads, and
        the optional talker-to-predictor input projection."""
        c = self.config.code_predictor.transformer
        proj = self.small_to_mtp_projection
        return DecoderView(
            family=ModelFamily.QWEN3_TTS_CODE_PREDICTOR,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            inv_freq=self.model.region_inv_freq(),
            layers=self.model.layer_weights(),
            final_norm=self.model.norm.weight,
            embed_tables=tuple(t.weight for t in self.model.codec_embedding),
            heads=tuple(h.weight for h in self.lm_head),
            projection=None if proj is None else (proj.weight, proj.bias),
            input_size=self.config.transformer.hidden_size,
        )

    @property
    def num_steps(self) -> int:
        return self.config.code_predictor.num_code_groups - 1

    def new_cache(self, batch_size: int) -> KVCache:
        """A cache for one frame of `batch_size` streams (Q positions each)."""
        param = self.lm_head[0].weight
        return KVCache(
            self.config.code_predictor.transformer,
            num_slots=batch_size,
            max_len=self.config.code_predictor.num_code_groups,
            device=param.device,
            dtype=param.dtype,
        )

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.small_to_mtp_projection is None else self.small_to_mtp_projection(x)

    def step_logits(self, inputs: torch.Tensor, step_idx: int, cache: KVCache) -> torch.Tensor:
        """One predictor forward for all B rows. step 0: inputs (B, 2, H_talker) = [hidden, emb(c0)];
        step j >= 1: inputs (B, 1, H_talker) = emb_{j-1}(c_j). Returns head j's logits (B, vocab)."""
        batch = inputs.shape[0]
        start = 0 if step_idx == 0 else step_idx + 1
        start_t = torch.full((batch,), start, dtype=torch.long, device=inputs.device)
        view = CacheView(
            cache=cache, slots=slice(0, batch), start=start_t, kv_len=start + inputs.shape[1], write_offset=start
        )
        h = self.model.run_layers(self._project(inputs), view)  # (B, T, H_pred)
        return self.lm_head[step_idx](h[:, -1])

    def embed_code(self, step_idx: int, codes: torch.Tensor) -> torch.Tensor:
        """Codebook `step_idx + 1` codes (B,) -> (B, H_talker) via table `step_idx`."""
        return self.model.codec_embedding[step_idx](codes)

    def predict(
        self,
        hidden: torch.Tensor,
        code0_embedding: torch.Tensor,
        choose: Callable[[int, torch.Tensor], torch.Tensor],
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """hidden, code0_embedding (B, H_talker) -> codes of codebooks 1..Q-1 (B, Q-1).

        `choose(step_idx, logits (B, vocab)) -> (B,) long` samples (or argmaxes) each head."""
        batch = hidden.shape[0]
        cache = cache if cache is not None else self.new_cache(batch)
        inputs = torch.stack((hidden, code0_embedding), dim=1)  # (B, 2, H_talker)
        codes = []
        for step_idx in range(self.num_steps):
            logits = self.step_logits(inputs, step_idx, cache)
            code = choose(step_idx, logits)
            codes.append(code)
            if step_idx + 1 < self.num_steps:
                inputs = self.embed_code(step_idx, code)[:, None]  # (B, 1, H_talker)
        return torch.stack(codes, dim=1)
