"""models.layers.slot_attention: one decode query per row against its own slot of a layer's KV cache,
read in place by FlashAttention's variable-length kernel (no gather of the slots' keys).

On CPU: the packed view and offsets (slot_key_offsets) address exactly each slot's keys, checked by
slot_attention_reference against attention over plainly indexed keys, in float64. On a GPU: the kernel
against that float64 reference on awkward shapes (unsorted and repeated slots, lengths from 1 to the
whole cache, GQA groups, head sizes 64 and 128), with every key past a row's length poisoned; and a whole
Llama decode step with slot attention against the gathered form it replaces.
"""

from __future__ import annotations

import pytest
import torch

from tilevox.models import layers
from tilevox.models.layers import slot_attention, slot_attention_reference, slot_attention_supported


def _plain_attention(q, keys, values, slots, lengths, scale) -> torch.Tensor:
    """float64 attention over keys[slots[b], kv, :lengths[b]] indexed directly (no packed view)."""
    batch, heads, _, head_dim = q.shape
    groups = heads // keys.shape[1]
    out = torch.empty(batch, heads, 1, head_dim, dtype=torch.float64)
    for row in range(batch):
        slot, count = int(slots[row]), int(lengths[row])
        for head in range(heads):
            k = keys[slot, head // groups, :count].double().cpu()
            v = values[slot, head // groups, :count].double().cpu()
            out[row, head, 0] = ((k @ q[row, head, 0].double().cpu()) * scale).softmax(0) @ v
    return out


def _case(generator, *, num_slots, num_kv, seq, head_dim, heads, slots, lengths, device, dtype):
    cache_shape = (num_slots, num_kv, seq, head_dim)
    keys = torch.randn(cache_shape, generator=generator).to(device, dtype)
    values = torch.randn(cache_shape, generator=generator).to(device, dtype)
    q = torch.randn((len(slots), heads, 1, head_dim), generator=generator).to(device, dtype)
    slots_t = torch.tensor(slots, device=device)
    lengths_t = torch.tensor(lengths, device=device)
    return q, keys, values, slots_t, lengths_t


def test_packed_offsets_address_each_slots_keys():
    generator = torch.Generator().manual_seed(7)
    q, keys, values, slots, lengths = _case(
        generator,
        num_slots=5,
        num_kv=3,
        seq=13,
        head_dim=8,
        heads=6,
        slots=[3, 0, 4, 0, 2],
        lengths=[1, 13, 7, 5, 12],
        device="cpu",
        dtype=torch.float64,
    )
    scale = 0.3
    expected = _plain_attention(q, keys, values, slots, lengths, scale)
    torch.testing.assert_close(slot_attention_reference(q, keys, values, slots, lengths, scale), expected)
    # A wrong offset would read another slot's keys: the last slot's last head ends the packed view.
    packed, cu = layers.slot_key_offsets(keys, slots)
    assert cu.dtype == torch.int32 and cu.tolist()[:-1] == [s * 3 * 13 for s in slots.tolist()]
    assert torch.equal(packed[int(cu[2]) : int(cu[2]) + 13, 2], keys[4, 2])
    assert packed.untyped_storage().data_ptr() == keys.untyped_storage().data_ptr()  # a view, no copy


def test_not_supported_on_cpu_or_fp32():
    q = torch.zeros(2, 4, 1, 64)
    keys = torch.zeros(3, 2, 16, 64)
    assert not slot_attention_supported(q, keys)
    assert not slot_attention_supported(q.bfloat16(), keys.bfloat16())  # CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")
@pytest.mark.parametrize(
    ("num_slots", "num_kv", "seq", "head_dim", "heads", "slots", "lengths"),
    [
        (7, 2, 301, 64, 8, [5, 0, 6, 2, 2], [1, 301, 77, 150, 3]),
        (9, 8, 1024, 64, 32, [8, 3, 1, 0, 7, 4, 6, 5, 2] * 4 + [3], None),
        (4, 8, 513, 128, 16, [3, 1], [513, 9]),
        (3, 1, 2048, 128, 14, [2], [1999]),
        (6, 2, 300, 16, 4, [4, 3, 2], [45, 6, 18]),  # llama-tiny's heads
        (5, 4, 77, 32, 8, [0, 4, 1, 3], [77, 1, 30, 64]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_float64_reference_with_poisoned_tails(
    num_slots, num_kv, seq, head_dim, heads, slots, lengths, dtype
):
    generator = torch.Generator().manual_seed(seq + heads)
    if lengths is None:
        lengths = torch.randint(1, seq + 1, (len(slots),), generator=generator).tolist()
    q, keys, values, slots_t, lengths_t = _case(
        generator,
        num_slots=num_slots,
        num_kv=num_kv,
        seq=seq,
        head_dim=head_dim,
        heads=heads,
        slots=slots,
        lengths=lengths,
        device="cuda",
        dtype=dtype,
    )
    # Poison every key and value no row may see: a slot's positions past the longest length any row reads it at.
    for slot in range(num_slots):
        seen = max((n for s, n in zip(slots, lengths) if s == slot), default=0)
        keys[slot, :, seen:] = float("nan")
        values[slot, :, seen:] = float("inf")
    assert slot_attention_supported(q, keys)
    scale = head_dim**-0.5
    out = slot_attention(q, keys, values, slots_t, lengths_t, max(lengths), scale)
    assert out.shape == q.shape and out.dtype == dtype
    expected = slot_attention_reference(q, keys, values, slots_t, lengths_t, scale)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")
def test_llama_decode_with_slot_attention_matches_the_gathered_form(monkeypatch):
    from tilevox.models.llasa.loader import load_preset

    model = load_preset("llama-tiny", device="cuda", dtype=torch.bfloat16, max_streams=6, max_seq_len=300)
    llama = model.llama
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=generator) for n in (5, 40, 17)]

    # Teacher-forced: the same tokens go in on both paths (fed-back argmaxes of a random model would
    # split at the first near-tie and compare different sequences).
    forced = torch.randint(0, 1000, (6, 3), generator=generator).cuda()

    def run(slot_path: bool) -> list[torch.Tensor]:
        if not slot_path:
            monkeypatch.setattr("tilevox.models.llama.model.slot_attention_supported", lambda q, k: False)
        cache = llama.new_cache(max_streams=6, max_seq_len=300)
        slots = [cache.allocate() for _ in range(5)][2:]  # slots 2, 3, 4: not row indices
        for slot, prompt in zip(slots, prompts):
            llama.prefill(cache, slot, prompt.cuda())
        outputs = [llama.decode(cache, slots[::-1], tokens).float() for tokens in forced]
        monkeypatch.undo()
        return outputs

    with torch.inference_mode():
        slot_outputs, gathered_outputs = run(True), run(False)
    for step, (got, want) in enumerate(zip(slot_outputs, gathered_outputs)):
        assert (got - want).abs().max() < 5e-2 * want.abs().max(), f"step {step}"
