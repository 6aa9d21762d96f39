"""The NH-TTS decoder over parallel codebooks (transformers' DiaDecoder + the `logits_dense` head) with a
row-indexed cache, and the whole network (`NhTtsNetwork`, parameter names as DiaForConditionalGeneration).

One decoder step takes one frame of `num_channels` codes per row, sums their embeddings (one table,
channel c at offset c x vocab_size), runs self-attention over the row's own cache (RoPE at the row's
position), cross-attention over the row's encoder keys/values (computed once per stream and kept in the
cache), the MLP, and returns logits for every channel (B, C, V). A stream with classifier-free guidance
owns two rows (conditional text, unconditional text); rows of different streams sit at different
positions and text lengths (each row's keys past its own position or text length are masked).
`NhTtsNetwork.decoder_view()` hands the decoder step to a region compiler (models.decoder_view, family
NH_TTS): the summed embeddings are the region's input, the cross caches are read where they lie.
Imports: torch, models.{layers,decoder_view,kv_cache_write}, models.nh_tts.{config,encoder}.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tilevox.models.decoder_view import (
    CrossAttentionShape,
    CrossAttentionWeights,
    DecoderView,
    LayerWeights,
    ModelFamily,
)
from tilevox.models.kv_cache_write import write_kv_cache
from tilevox.models.layers import RMSNorm
from tilevox.models.nh_tts.config import NhDecoderConfig, NhTtsConfig
from tilevox.models.nh_tts.encoder import (
    FusedGateUpMLP,
    NhAttentionProjections,
    NhTextEncoder,
    _Embedding,
    _Linear,
    apply_rope,
    attend,
    rope_cos_sin,
    rope_inv_freq,
)

__all__ = ["NhDecoder", "NhDecoderCache", "NhTtsNetwork"]


class NhDecoderCache:
    """Self-attention keys/values and cross-attention keys/values for `max_rows` rows.

    self_k/self_v: (layers, rows, kv_heads, max_seq_len, head_dim); cross_k/cross_v: (layers, rows,
    cross_kv_heads, max_text_len, cross_head_dim). `lengths[row]` positions hold valid self keys,
    `text_lengths[row]` valid cross keys; the rest is stale and always masked."""

    def __init__(
        self, config: NhDecoderConfig, *, max_rows: int, max_seq_len: int, max_text_len: int, device, dtype
    ) -> None:
        if max_rows <= 0:
            raise ValueError(f"max_rows must be positive, got {max_rows}")
        if max_seq_len <= 0 or max_text_len <= 0:
            raise ValueError(f"max_seq_len ({max_seq_len}) and max_text_len ({max_text_len}) must be positive")
        layers = config.num_hidden_layers
        self_shape = (layers, max_rows, config.num_key_value_heads, max_seq_len, config.head_dim)
        cross_shape = (layers, max_rows, config.cross_num_key_value_heads, max_text_len, config.cross_head_dim)
        self.self_k = torch.zeros(self_shape, device=device, dtype=dtype)
        self.self_v = torch.zeros(self_shape, device=device, dtype=dtype)
        self.cross_k = torch.zeros(cross_shape, device=device, dtype=dtype)
        self.cross_v = torch.zeros(cross_shape, device=device, dtype=dtype)
        self.text_lengths_device = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.max_rows, self.max_seq_len, self.max_text_len = max_rows, max_seq_len, max_text_len
        self.lengths = [0] * max_rows
        self.text_lengths = [0] * max_rows
        self._in_use = [False] * max_rows

    @staticmethod
    def bytes_per_row(config: NhDecoderConfig, *, max_seq_len: int, max_text_len: int, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        per_layer = 2 * (
            config.num_key_value_heads * max_seq_len * config.head_dim
            + config.cross_num_key_value_heads * max_text_len * config.cross_head_dim
        )
        return config.num_hidden_layers * per_layer * size

    @property
    def num_free(self) -> int:
        return self._in_use.count(False)

    def claim(self, rows: Sequence[int]) -> None:
        """Take these free rows (lengths 0); ValueError if one is taken or out of range."""
        taken = [r for r in rows if not (0 <= r < self.max_rows) or self._in_use[r]]
        if taken:
            raise ValueError(f"cache rows {taken} are in use or out of range (max_rows {self.max_rows})")
        for row in rows:
            self._in_use[row] = True
            self.lengths[row] = 0
            self.text_lengths[row] = 0

    def free(self, rows: Sequence[int]) -> None:
        for row in rows:
            if not (0 <= row < self.max_rows and self._in_use[row]):
                raise ValueError(f"cache row {row} is not allocated")
            self._in_use[row] = False
            self.lengths[row] = 0
            self.text_lengths[row] = 0

    def is_allocated(self, row: int) -> bool:
        return 0 <= row < self.max_rows and self._in_use[row]


class NhDecoderLayer(nn.Module):
    def __init__(self, config: NhDecoderConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        h = config.hidden_size
        self.self_attention = NhAttentionProjections(
            h, h, config.num_attention_heads, config.num_key_value_heads, config.head_dim, **kw
        )
        self.cross_attention = NhAttentionProjections(
            h,
            config.cross_hidden_size,
            config.cross_num_attention_heads,
            config.cross_num_key_value_heads,
            config.cross_head_dim,
            **kw,
        )
        self.pre_sa_norm = RMSNorm(h, config.norm_eps, **kw)
        self.pre_ca_norm = RMSNorm(h, config.norm_eps, **kw)
        self.pre_mlp_norm = RMSNorm(h, config.norm_eps, **kw)
        self.mlp = FusedGateUpMLP(h, config.intermediate_size, **kw)


class NhMultiChannelEmbedding(nn.Module):
    def __init__(self, config: NhDecoderConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.embed = _Embedding(config.vocab_size * config.num_channels, config.hidden_size, device=device, dtype=dtype)
        offsets = torch.arange(config.num_channels, dtype=torch.long) * config.vocab_size
        self.register_buffer("offsets", offsets.to(device) if device is not None else offsets, persistent=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, T, C) -> (B, T, hidden): the sum of the channels' embeddings."""
        return self.embed(codes + self.offsets).sum(dim=2)


class NhDecoder(nn.Module):
    def __init__(self, config: NhDecoderConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        kw = {"device": device, "dtype": dtype}
        self.embeddings = NhMultiChannelEmbedding(config, **kw)
        self.layers = nn.ModuleList(NhDecoderLayer(config, **kw) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, **kw)
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta)
        self.register_buffer("inv_freq", inv_freq.to(device) if device is not None else inv_freq, persistent=False)

    @torch.no_grad()
    def write_cross(
        self, cache: NhDecoderCache, rows: Sequence[int], encoded: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """Each row's cross-attention keys/values from its encoder output (B, T, cross_hidden) and validity
        (B, T) bool (right-padded), into the cache; computed once per stream."""
        width = encoded.shape[1]
        if width > cache.max_text_len:
            raise ValueError(f"text of {width} positions exceeds the cache's max_text_len {cache.max_text_len}")
        index = torch.tensor(list(rows), dtype=torch.long, device=encoded.device)
        for layer_id, layer in enumerate(self.layers):
            k, v = layer.cross_attention.keys_values(encoded)  # (B, KV, T, D)
            cache.cross_k[layer_id, index, :, :width] = k.to(cache.cross_k.dtype)
            cache.cross_v[layer_id, index, :, :width] = v.to(cache.cross_v.dtype)
        lengths = valid.sum(dim=1)
        cache.text_lengths_device[index] = lengths.to(cache.text_lengths_device.device)
        for row, length in zip(rows, lengths.tolist(), strict=True):
            cache.text_lengths[row] = int(length)

    def forward(self, cache: NhDecoderCache, rows: Sequence[int], codes: torch.Tensor) -> torch.Tensor:
        """Append `codes` (B, T, C) at each row's next positions; returns the final-norm hidden state of each
        row's last new position (B, hidden). Rows must be distinct allocated rows with room for T."""
        batch, steps, _ = codes.shape
        if len(rows) != batch or len(set(rows)) != batch:
            raise ValueError(f"one distinct cache row per batch row: {len(rows)} rows for a batch of {batch}")
        starts = [cache.lengths[r] for r in rows]
        bad = [r for r, s in zip(rows, starts) if not cache.is_allocated(r) or s + steps > cache.max_seq_len]
        if bad:
            raise ValueError(f"cache rows {bad} are not allocated or have no room for {steps} more positions")
        device = codes.device
        index = torch.tensor(list(rows), dtype=torch.long, device=device)
        positions = torch.tensor(starts, dtype=torch.long, device=device)[:, None] + torch.arange(steps, device=device)
        num_keys = max(starts) + steps
        num_text = max(cache.text_lengths[r] for r in rows)
        hidden = self.forward_static(cache, index, positions, codes, num_keys=num_keys, num_text=num_text)
        for r in rows:
            cache.lengths[r] += steps
        return hidden

    def forward_static(
        self,
        cache: NhDecoderCache,
        index: torch.Tensor,
        positions: torch.Tensor,
        codes: torch.Tensor,
        *,
        num_keys: int,
        num_text: int,
    ) -> torch.Tensor:
        """`forward` on device tensors only (no host bookkeeping, so it can be captured in a CUDA graph): rows
        `index` (B,), their positions (B, T), codes (B, T, C); keys [0, num_keys) and text [0, num_text) are
        read, each row masked to its own position and text length. The caller advances cache.lengths."""
        x = self.forward_layers(cache, index, positions, self.embeddings(codes), num_keys=num_keys, num_text=num_text)
        return self.norm(x[:, -1])

    def forward_layers(
        self,
        cache: NhDecoderCache,
        index: torch.Tensor,
        positions: torch.Tensor,
        x: torch.Tensor,
        *,
        num_keys: int,
        num_text: int,
        first: int = 0,
        stop: int | None = None,
    ) -> torch.Tensor:
        """The residual stream x (B, T, hidden) through layers [first, stop) (None: the last), as forward_static
        runs them, no final norm: a piece of a step cut at layer boundaries (executor.split)."""
        device = x.device
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        key_pos = torch.arange(num_keys, device=device)
        self_mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # (B, 1, T, keys)
        text_pos = torch.arange(num_text, device=device)
        cross_mask = (text_pos[None, :] < cache.text_lengths_device[index][:, None])[:, None, None]  # (B, 1, 1, text)
        stop = len(self.layers) if stop is None else stop
        for layer_id in range(first, stop):
            layer = self.layers[layer_id]
            h = layer.pre_sa_norm(x)
            attn = layer.self_attention
            q = apply_rope(attn.queries(h), cos, sin)
            k, v = attn.keys_values(h)
            k = apply_rope(k, cos, sin)
            layer_k, layer_v = cache.self_k[layer_id], cache.self_v[layer_id]
            if torch.compiler.is_compiling():
                # Through the op a compiled graph keeps in place (models.kv_cache_write): this indexed write
                # into a layer's view is functionalized into a scatter that Inductor leaves as a copy.
                dtype = cache.self_k.dtype
                write_kv_cache(cache.self_k, cache.self_v, layer_id, index, positions, k.to(dtype), v.to(dtype))
            else:
                layer_k[index[:, None], :, positions] = k.transpose(1, 2).to(layer_k.dtype)
                layer_v[index[:, None], :, positions] = v.transpose(1, 2).to(layer_v.dtype)
            keys, values = layer_k[index, :, :num_keys], layer_v[index, :, :num_keys]
            x = x + attn.o_proj(attend(q, keys, values, self_mask))
            h = layer.pre_ca_norm(x)
            cross = layer.cross_attention
            ck, cv = cache.cross_k[layer_id][index, :, :num_text], cache.cross_v[layer_id][index, :, :num_text]
            x = x + cross.o_proj(attend(cross.queries(h), ck, cv, cross_mask))
            x = x + layer.mlp(layer.pre_mlp_norm(x))
        return x


class _DiaModel(nn.Module):
    """The `model.` prefix of DiaForConditionalGeneration's parameter names."""

    def __init__(self, config: NhTtsConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.encoder = NhTextEncoder(config.encoder, device=device, dtype=dtype)
        self.decoder = NhDecoder(config.decoder, device=device, dtype=dtype)


class NhTtsNetwork(nn.Module):
    """Text encoder + decoder + the all-channel head, with DiaForConditionalGeneration's parameter names."""

    def __init__(self, config: NhTtsConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.model = _DiaModel(config, device=device, dtype=dtype)
        dec = config.decoder
        self.logits_dense = _Linear(
            dec.hidden_size, dec.num_channels * dec.vocab_size, bias=False, device=device, dtype=dtype
        )

    @property
    def encoder(self) -> NhTextEncoder:
        return self.model.encoder

    @property
    def decoder(self) -> NhDecoder:
        return self.model.decoder

    @property
    def device(self) -> torch.device:
        return self.logits_dense.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.logits_dense.weight.dtype

    def decoder_view(self) -> DecoderView:
        """The weights a region compiler reads (models.decoder_view, family NH_TTS): each layer's self-attention
        (GQA, RoPE, scale 1: Dia folds 1/sqrt(d) into its query weights), cross-attention (query and output
        projections; its keys/values are the cache's cross_k/cross_v, written by write_cross) and MLP (gate
        and up are the two row halves of gate_up_proj, views), the final norm and the all-channel head
        (channels x vocab rows). The region's input is the summed codebook embeddings (`decoder.embeddings`)."""
        dec = self.config.decoder
        layers = []
        for layer in self.decoder.layers:
            attn, cross, mlp = layer.self_attention, layer.cross_attention, layer.mlp
            gate, up = mlp.gate_up_proj.weight.chunk(2, dim=0)
            layers.append(
                LayerWeights(
                    ln1=layer.pre_sa_norm.weight,
                    w_q=attn.q_proj.weight,
                    w_k=attn.k_proj.weight,
                    w_v=attn.v_proj.weight,
                    qk_norm=None,
                    w_o=attn.o_proj.weight,
                    ln2=layer.pre_mlp_norm.weight,
                    w_gate=gate,
                    w_up=up,
                    w_down=mlp.down_proj.weight,
                    cross=CrossAttentionWeights(
                        ln=layer.pre_ca_norm.weight, w_q=cross.q_proj.weight, w_o=cross.o_proj.weight
                    ),
                )
            )
        return DecoderView(
            family=ModelFamily.NH_TTS,
            hidden_size=dec.hidden_size,
            intermediate_size=dec.intermediate_size,
            num_heads=dec.num_attention_heads,
            num_kv_heads=dec.num_key_value_heads,
            head_dim=dec.head_dim,
            rms_norm_eps=dec.norm_eps,
            inv_freq=self.decoder.inv_freq,
            layers=tuple(layers),
            final_norm=self.decoder.norm.weight,
            embed_tables=(),
            heads=(self.logits_dense.weight,),
            projection=None,
            input_size=dec.hidden_size,
            attn_scale=1.0,
            cross=CrossAttentionShape(
                num_heads=dec.cross_num_attention_heads,
                num_kv_heads=dec.cross_num_key_value_heads,
                head_dim=dec.cross_head_dim,
                max_text_len=self.config.encoder.max_position_embeddings,
            ),
        )

    def new_cache(self, *, max_rows: int, max_seq_len: int, max_text_len: int) -> NhDecoderCache:
        return NhDecoderCache(
            self.config.decoder,
            max_rows=max_rows,
            max_seq_len=max_seq_len,
            max_text_len=max_text_len,
            device=self.device,
            dtype=self.dtype,
        )

    @torch.no_grad()
    def encode_text(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids, valid)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream (B, hidden) after the last decoder layer -> logits (B, C, V), as step returns them."""
        dec = self.config.decoder
        return self.logits_dense(self.decoder.norm(x)).view(x.shape[0], dec.num_channels, dec.vocab_size)

    @torch.no_grad()
    def step(self, cache: NhDecoderCache, rows: Sequence[int], codes: torch.Tensor) -> torch.Tensor:
        """One decoder call: codes (B, T, C) appended to `rows` -> logits of each row's last position (B, C, V)."""
        hidden = self.decoder(cache, rows, codes)
        dec = self.config.decoder
        return self.logits_dense(hidden).view(hidden.shape[0], dec.num_channels, dec.vocab_size)
