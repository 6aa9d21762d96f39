"""Llama decoder (as transformers' LlamaForCausalLM computes it) over a slot-based batched KV cache.

`LlamaKVCache` is a fixed pool of `max_streams` slots x `max_seq_len` positions; each stream owns a
slot and a length. `LlamaForCausalLM.prefill` appends a prompt to one slot, `decode` appends one token
to each of several slots that sit at different positions (keys past a stream's own position are
masked). Module and parameter names equal transformers' so checkpoints load by name.
Imports: torch, models.{layers,host_copy,decoder_view,kv_cache_write} and models.llama.config only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from tilevox.models.decoder_view import DecoderView, ModelFamily, layer_weights_of
from tilevox.models.host_copy import to_device
from tilevox.models.kv_cache_write import write_kv_cache
from tilevox.models.layers import GatedMLP, RMSNorm, gather_keys, slot_attention, slot_attention_supported
from tilevox.models.llama.config import LlamaConfig

__all__ = [
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaKVCache",
    "LlamaModel",
    "rope_inv_freq",
]


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Rotary inverse frequencies (head_dim / 2,), fp32 on CPU, with llama3 band scaling if configured.

    Computed on CPU in fp32 like transformers does at init, so every device sees the same values."""
    dim = config.resolved_head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_type == "default":
        return inv_freq
    factor = config.rope_factor
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    old_context = config.rope_original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (beyond old_context / low) are slowed by `factor`, short ones (below
    # old_context / high) kept, and the band between interpolates linearly in old_context / wavelen.
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_middle = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(is_middle, smoothed, scaled)


class _Linear(nn.Linear):
    """nn.Linear without the init pass at construction: random_llama and load_llama always set the
    weights, and skipping kaiming init saves seconds for a 1B model on CPU."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    """nn.Embedding without the init pass at construction (see _Linear)."""

    def reset_parameters(self) -> None:
        pass


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaKVCache:
    """Keys and values for `max_streams` independent streams, one slot each.

    k, v: (num_layers, max_streams, num_kv_heads, max_seq_len, head_dim). `lengths[slot]` is how many
    positions of the slot hold valid keys; the rest are stale and always masked."""

    def __init__(self, config: LlamaConfig, *, max_streams: int, max_seq_len: int, device, dtype: torch.dtype) -> None:
        if max_streams <= 0:
            raise ValueError(f"max_streams must be positive, got {max_streams}")
        if not (0 < max_seq_len <= config.max_position_embeddings):
            raise ValueError(
                f"max_seq_len must be in [1, {config.max_position_embeddings}] (max_position_embeddings), "
                f"got {max_seq_len}"
            )
        shape = (
            config.num_hidden_layers,
            max_streams,
            config.num_key_value_heads,
            max_seq_len,
            config.resolved_head_dim,
        )
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.layer_ids = torch.arange(config.num_hidden_layers, device=device)  # see LlamaAttention.forward
        self.max_streams = max_streams
        self.max_seq_len = max_seq_len
        self.lengths = [0] * max_streams
        self._in_use = [False] * max_streams

    @property
    def num_free(self) -> int:
        return self._in_use.count(False)

    def allocate(self) -> int:
        """Take the lowest free slot (length 0); raises RuntimeError when all are in use."""
        for slot, used in enumerate(self._in_use):
            if not used:
                self._in_use[slot] = True
                self.lengths[slot] = 0
                return slot
        raise RuntimeError(f"all {self.max_streams} KV cache slots are in use; free one first")

    def free(self, slot: int) -> None:
        self._check_slot(slot)
        self._in_use[slot] = False
        self.lengths[slot] = 0

    def takes_decode(self, slots: Sequence[int], num_tokens: int) -> bool:
        """Whether decode of `num_tokens` tokens into `slots` is well formed: distinct allocated slots with
        room, one token each (decode raises a precise error otherwise; other executors call it then)."""
        return (
            bool(slots)
            and num_tokens == len(slots)
            and len(set(slots)) == len(slots)
            and all(self.is_allocated(s) and self.lengths[s] < self.max_seq_len for s in slots)
        )

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.max_streams and self._in_use[slot]

    def _check_slot(self, slot: int) -> None:
        if not self.is_allocated(slot):
            raise ValueError(f"KV cache slot {slot} is not allocated")


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.resolved_head_dim
        self.scale = self.head_dim**-0.5
        h, bias = config.hidden_size, config.attention_bias
        kw = {"device": device, "dtype": dtype}
        self.q_proj = _Linear(h, self.num_heads * self.head_dim, bias=bias, **kw)
        self.k_proj = _Linear(h, self.num_kv_heads * self.head_dim, bias=bias, **kw)
        self.v_proj = _Linear(h, self.num_kv_heads * self.head_dim, bias=bias, **kw)
        self.o_proj = _Linear(self.num_heads * self.head_dim, h, bias=bias, **kw)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LlamaKVCache,
        slots: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor,
    ) -> torch.Tensor:
        """x (B, T, hidden); cos/sin (B, T, head_dim); slots (B,); positions (B, T); key_mask (B, T, S)
        True where query t of row b may see cached key s. Writes this step's keys, then attends."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin

        if torch.compiler.is_compiling():
            # Through the op a compiled graph keeps in place (models.kv_cache_write): an indexed write is
            # functionalized into a scatter of the cache that Inductor may leave as a copy of all of it.
            write_kv_cache(cache.k, cache.v, self.layer_idx, slots, positions, k, v.transpose(1, 2))
        else:
            # Written through the whole cache, the layer as an index: advanced indices split by a slice put
            # the broadcast (B, T) dims first: targets are (B, T, Hkv, D).
            layer = cache.layer_ids[self.layer_idx : self.layer_idx + 1, None]
            cache.k[layer, slots[:, None], :, positions] = k.transpose(1, 2)
            cache.v[layer, slots[:, None], :, positions] = v
        k_layer, v_layer = cache.k[self.layer_idx], cache.v[self.layer_idx]  # (slots, Hkv, S_max, D)
        num_keys = key_mask.shape[-1]
        if seq == 1 and slot_attention_supported(q, k_layer):
            # One new position per row: attend to each row's slot in place (key_mask is the prefix
            # [0, position]; positions < num_keys).
            out = slot_attention(q, k_layer, v_layer, slots, positions[:, 0] + 1, num_keys, self.scale)
            return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))
        keys, values = gather_keys(k_layer, v_layer, slots, num_keys)  # (B, Hkv, S, D) each

        # GQA without repeating keys: query head h uses kv head h // G, so group the G query heads of
        # each kv head along the row axis.
        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(batch, self.num_kv_heads, groups * seq, self.head_dim)  # (B, Hkv, G*T, D)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale  # (B, Hkv, G*T, S)
        scores = scores.view(batch, self.num_kv_heads, groups, seq, num_keys)
        scores = scores.masked_fill(~key_mask[:, None, None], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        probs = probs.view(batch, self.num_kv_heads, groups * seq, num_keys)
        out = torch.matmul(probs, values)  # (B, Hkv, G*T, D)
        out = out.view(batch, self.num_heads, seq, self.head_dim).transpose(1, 2)  # (B, T, H, D)
        return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.self_attn = LlamaAttention(config, layer_idx, **kw)
        # skip_init: random_llama and load_llama always set the weights (see _Linear)
        self.mlp = nn.utils.skip_init(
            GatedMLP,
            config.hidden_size,
            config.intermediate_size,
            bias=config.mlp_bias,
            device=device or torch.get_default_device(),
            dtype=dtype,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def forward(self, x, cos, sin, cache, slots, positions, key_mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, slots, positions, key_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, **kw) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)


class LlamaForCausalLM(nn.Module):
    """Parameters named as transformers' LlamaForCausalLM; run it through `prefill` and `decode`.

    Construction leaves matrices uninitialised: build it with models.llama.weights (random_llama,
    load_llama)."""

    def __init__(self, config: LlamaConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, device=device, dtype=dtype)
        self.lm_head = _Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
        self.tie_weights()
        self._inv_freq_cpu = rope_inv_freq(config)
        # fp32 on the parameters' device, set here and on every move (_apply), never inside forward: a compiled
        # forward that creates it on its first call is compiled again on its second (Dynamo guards on it being
        # None), and the executor's second call is its CUDA-graph capture, where compiling fails (H100,
        # 2026-12-07: the compiled Llasa prefill).
        self._inv_freq = self._inv_freq_cpu.to(self.lm_head.weight.device)

    def _apply(self, fn, recurse=True):
        """nn.Module._apply (to, cuda, to_empty, ...), then the fp32 rope table on the new device: a dtype cast
        of the module never reaches it (transformers computes the rope angles in fp32)."""
        module = super()._apply(fn, recurse)
        self._inv_freq = self._inv_freq_cpu.to(self.lm_head.weight.device)
        return module

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def decoder_view(self) -> DecoderView:
        """The weights a region compiler reads (models.decoder_view); no copies."""
        c = self.config
        if c.attention_bias or c.mlp_bias:
            raise ValueError("Llama regions do not support attention_bias / mlp_bias")
        layers = tuple(layer_weights_of(layer) for layer in self.model.layers)
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
            final_norm=self.model.norm.weight,
            embed_tables=(self.model.embed_tokens.weight,),
            heads=(self.lm_head.weight,),
            projection=None,
            input_size=c.hidden_size,
        )

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, *, max_streams: int, max_seq_len: int) -> LlamaKVCache:
        return LlamaKVCache(
            self.config, max_streams=max_streams, max_seq_len=max_seq_len, device=self.device, dtype=self.dtype
        )

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq.device != positions.device:
            raise ValueError(f"positions on {positions.device}, the model on {self._inv_freq.device}")
        freqs = positions.to(torch.float32)[..., None] * self._inv_freq  # (B, T, D/2), fp32 as transformers
        angles = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(
        self, token_ids: torch.Tensor, cache: LlamaKVCache, slots: torch.Tensor, positions: torch.Tensor, num_keys: int
    ) -> torch.Tensor:
        """token_ids, positions (B, T) on the model's device; slots (B,). Returns hidden states (B, T, hidden)
        after the final norm; attends to cached keys [0, num_keys) up to each query's own position."""
        x = self.model.embed_tokens(token_ids)
        return self.model.norm(self.forward_layers(x, cache, slots, positions, num_keys))

    def forward_layers(
        self,
        x: torch.Tensor,
        cache: LlamaKVCache,
        slots: torch.Tensor,
        positions: torch.Tensor,
        num_keys: int,
        first: int = 0,
        stop: int | None = None,
    ) -> torch.Tensor:
        """The residual stream x (B, T, hidden) through layers [first, stop) (None: the last), no final norm:
        a piece of a decode step cut at layer boundaries (executor.split), the rest as `forward`."""
        cos, sin = self._rope(positions, x.dtype)
        key_idx = torch.arange(num_keys, device=positions.device)
        key_mask = key_idx[None, None, :] <= positions[:, :, None]  # (B, T, S)
        for layer in self.model.layers[first:stop]:
            x = layer(x, cos, sin, cache, slots, positions, key_mask)
        return x

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: the residual stream a decode step starts from."""
        return self.model.embed_tokens(token_ids)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the last layer -> logits (final norm, then lm_head)."""
        return self.lm_head(self.model.norm(x))

    @torch.inference_mode()
    def prefill(
        self, cache: LlamaKVCache, slot: int, token_ids: torch.Tensor, *, all_logits: bool = False
    ) -> torch.Tensor:
        """Append `token_ids` (T,) to `slot`; returns the last position's logits (V,), or (T, V) with all_logits."""
        cache._check_slot(slot)
        if token_ids.dim() != 1 or token_ids.numel() == 0:
            raise ValueError(f"prefill token_ids must be a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}")
        start, count = cache.lengths[slot], token_ids.numel()
        if start + count > cache.max_seq_len:
            raise ValueError(
                f"prefill of {count} tokens at position {start} exceeds the cache length {cache.max_seq_len}"
            )
        lowest, highest = int(token_ids.min()), int(token_ids.max())
        if lowest < 0 or highest >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got range [{lowest}, {highest}]")
        device = self.device
        positions = torch.arange(start, start + count, device=device)[None]  # (1, T)
        slots = torch.tensor([slot], device=device)
        hidden = self.forward(token_ids.to(device)[None], cache, slots, positions, start + count)
        cache.lengths[slot] = start + count
        if all_logits:
            return self.lm_head(hidden[0])
        return self.lm_head(hidden[0, -1])

    @torch.inference_mode()
    def prefill_many(self, cache: LlamaKVCache, slots: Sequence[int], prompts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Append each prompt (T_b,) to its empty slot in one batched forward; returns each one's last
        position's logits (B, V). The prompts are right-padded to the longest: the padding's keys land past
        each slot's length, where attention never looks and where decoding writes before it reads."""
        tokens, lengths = self.prompt_batch(cache, slots, prompts)
        device = self.device
        last = to_device(lengths, dtype=torch.long, device=device) - 1
        slot_t = to_device([int(s) for s in slots], dtype=torch.long, device=device)
        logits = self.prefill_tokens(tokens, cache, slot_t, last)
        for slot, length in zip(slots, lengths):
            cache.lengths[int(slot)] = length
        return logits

    def prompt_batch(
        self, cache: LlamaKVCache, slots: Sequence[int], prompts: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, list[int]]:
        """Check a batched prefill (distinct empty slots, non-empty prompts of valid ids that fit) and return
        the prompts right-padded with id 0 into (B, longest) on the device, and their lengths."""
        slots = [int(s) for s in slots]
        if len(slots) != len(prompts) or not slots or len(set(slots)) != len(slots):
            raise ValueError(f"prefill_many needs distinct slots, one prompt each: {slots}, {len(prompts)} prompts")
        for slot, prompt in zip(slots, prompts):
            cache._check_slot(slot)
            if cache.lengths[slot] != 0:
                raise ValueError(f"prefill_many fills empty slots; slot {slot} holds {cache.lengths[slot]} positions")
            if prompt.dim() != 1 or prompt.numel() == 0:
                raise ValueError(f"prefill token_ids must be a non-empty 1-D tensor, got shape {tuple(prompt.shape)}")
        lengths = [int(p.numel()) for p in prompts]
        longest = max(lengths)
        if longest > cache.max_seq_len:
            raise ValueError(f"prefill of {longest} tokens exceeds the cache length {cache.max_seq_len}")
        # Padded and checked on the host, then one pinned asynchronous copy: host prompts (the tokenizer's)
        # never make a prefill wait for the device (a prefill on its own stream: models.cuda_streams).
        padded = torch.zeros(len(slots), longest, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            padded[row, : lengths[row]] = prompt.to("cpu")
        lowest, highest = int(padded.min()), int(padded.max())  # the padding (0) is a valid id
        if lowest < 0 or highest >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got range [{lowest}, {highest}]")
        if self.device.type != "cuda":
            return padded.to(self.device), lengths
        return padded.pin_memory().to(self.device, non_blocking=True), lengths

    def prefill_tokens(
        self, tokens: torch.Tensor, cache: LlamaKVCache, slots: torch.Tensor, last: torch.Tensor
    ) -> torch.Tensor:
        """Right-padded prompts (B, T) written from position 0 of `slots` (B,): logits (B, V) at each row's
        `last` position. Tensors only (no host values): a CUDA graph can capture it. Leaves cache.lengths."""
        batch, length = tokens.shape
        positions = torch.arange(length, device=tokens.device)[None].expand(batch, length)
        hidden = self.forward(tokens, cache, slots, positions, length)  # (B, T, H)
        return self.lm_head(hidden[torch.arange(batch, device=tokens.device), last])

    @torch.inference_mode()
    def decode(self, cache: LlamaKVCache, slots: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor:
        """Append one token per stream: token_ids (B,) to `slots` (B distinct); returns logits (B, V)."""
        slots = [int(s) for s in slots]
        if token_ids.shape != (len(slots),) or not slots:
            raise ValueError(f"decode needs one token per slot: {len(slots)} slots, token_ids {tuple(token_ids.shape)}")
        if len(set(slots)) != len(slots):
            raise ValueError(f"decode slots must be distinct, got {slots}")
        for slot in slots:
            cache._check_slot(slot)
            if cache.lengths[slot] >= cache.max_seq_len:
                raise ValueError(f"KV cache slot {slot} is full ({cache.max_seq_len} positions)")
        device = self.device
        position_list = [cache.lengths[s] for s in slots]
        positions = to_device(position_list, dtype=torch.long, device=device)[:, None]  # (B, 1)
        slot_t = to_device(slots, dtype=torch.long, device=device)
        hidden = self.forward(token_ids.to(device)[:, None], cache, slot_t, positions, max(position_list) + 1)
        for slot in slots:
            cache.lengths[slot] += 1
        return self.lm_head(hidden[:, 0])
