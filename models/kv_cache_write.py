"""The KV-cache write of a compiled step: `tilevox::write_kv_cache`, a custom op that writes new keys and
values into a (layers, slots, kv_heads, positions, head_dim) cache in place, and its reference.

Why an op: under torch.compile a plain indexed write into a cache that the step also reads is functionalized
into an out-of-place `index_put` / `select_scatter` / `slice_scatter` of the cache tensor, and wherever
Inductor does not turn that back into an in-place write it allocates and copies the whole cache, every call
(a compiled talker prefill copied the whole key tensor: 28 GiB for Qwen3-TTS-0.6B's 256-stream cache, the
H200's out-of-memory under `tilevox synth --compile on`). A custom op that declares `keys`/`values` mutated is functionalized as one auto_functionalized node on
the cache tensor itself (a graph input), which Inductor re-inplaces (it calls the op on the input, no clone)
without looking into what the op writes. The op's body is the plain index write (write_kv_cache_reference):
no host synchronisation and no data-dependent shape, so a CUDA graph captures it.

The eager (uncompiled) paths keep their own plain writes: the models call `write_kv_cache` only while
torch.compile traces (`torch.compiler.is_compiling()`). Imports: torch only.
"""

from __future__ import annotations

import torch

__all__ = ["OP_NAME", "write_kv_cache", "write_kv_cache_reference"]

OP_NAME = "tilevox::write_kv_cache"


def write_kv_cache_reference(
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """keys, values (L, N, KV, S, D): row b's T new keys k[b] (KV, T, D) go to slot slots[b] (B,) of layer
    `layer` at positions[b] (B, T) long; values likewise (the plain index write)."""
    rows = slots[:, None]  # advanced indices split by a slice put the broadcast (B, T) first: (B, T, KV, D)
    keys[layer][rows, :, positions] = k.transpose(1, 2)
    values[layer][rows, :, positions] = v.transpose(1, 2)


@torch.library.custom_op(OP_NAME, mutates_args=("keys", "values"))
def write_kv_cache(
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """write_kv_cache_reference in place, as one op a compiled graph keeps in place (see the module doc)."""
    write_kv_cache_reference(keys, values, layer, slots, positions, k, v)


@write_kv_cache.register_fake
def _write_kv_cache_fake(keys, values, layer, slots, positions, k, v) -> None:
    return None
