"""Exact incremental decoding: any split of an utterance decodes to the full decode's samples.

Random weights (seeded, non-degenerate), fp32, > 400 frames so every attention layer has evicted
keys many times over (window 72). One check runs the official architecture sizes (slow).
"""

import pytest
import torch

from tilevox.models.qwen3_tts.speech_tokenizer import PRESETS, DecoderState, random_speech_tokenizer

TOL = 1e-5
SPF = 1920  # samples per frame


def _random_codes(config, batch, frames, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.decoder.codebook_size, (batch, config.num_quantizers, frames), generator=generator)


def _decode_in_pieces(decoder, codes, sizes_seed=None):
    """Feed `codes` through decode_incremental, one frame at a time or in random sizes 1..5."""
    state = decoder.new_state(codes.shape[0])
    generator = torch.Generator().manual_seed(sizes_seed or 0)
    pieces, start = [], 0
    while start < codes.shape[-1]:
        n = 1 if sizes_seed is None else int(torch.randint(1, 6, (1,), generator=generator))
        out = decoder.decode_incremental(codes[..., start : start + n], state)
        assert out.shape == (codes.shape[0], min(n, codes.shape[-1] - start) * SPF)
        pieces.append(out)
        start += n
    assert state.positions.tolist() == [codes.shape[-1]] * codes.shape[0]
    return torch.cat(pieces, dim=-1)


@pytest.fixture(scope="module")
def tiny():
    config = PRESETS["tiny"]
    decoder, _ = random_speech_tokenizer(config, seed=11, with_encoder=False)
    codes = _random_codes(config, batch=2, frames=413, seed=5)
    with torch.no_grad():
        full = decoder(codes)
    return config, decoder, codes, full


def test_full_decode_is_not_degenerate(tiny):
    _, _, codes, full = tiny
    assert full.shape == (2, codes.shape[-1] * SPF)
    assert full.std() > 0.05, "random decoder should not be silent"
    assert (full.abs() >= 1.0).float().mean() < 0.05, "random decoder should not sit on the +-1 clamp"
    assert not torch.equal(full[0], full[1])


@torch.no_grad()
def test_frame_by_frame_equals_full_decode(tiny):
    _, decoder, codes, full = tiny
    streamed = _decode_in_pieces(decoder, codes[:1])
    assert (streamed - full[:1]).abs().max().item() <= TOL


@torch.no_grad()
def test_random_chunk_sizes_equal_full_decode(tiny):
    _, decoder, codes, full = tiny
    streamed = _decode_in_pieces(decoder, codes, sizes_seed=3)
    assert (streamed - full).abs().max().item() <= TOL


@torch.no_grad()
def test_full_decode_has_zero_lookahead(tiny):
    _, decoder, codes, full = tiny
    prefix = decoder(codes[..., :97])
    assert (prefix - full[..., : 97 * SPF]).abs().max().item() <= TOL


@torch.no_grad()
def test_streams_at_different_offsets_step_together(tiny):
    """A running stream and a new one merged into one batch state give each stream its own audio."""
    config, decoder, _, _ = tiny
    codes_a = _random_codes(config, batch=1, frames=110, seed=21)
    codes_b = _random_codes(config, batch=1, frames=30, seed=22)
    state_a = decoder.new_state(1)
    head = decoder.decode_incremental(codes_a[..., :80], state_a)
    state = DecoderState.cat([state_a, decoder.new_state(1)])
    outs = []
    for i in range(0, 30, 5):  # both rows advance 5 frames per call, at positions 80+i and i
        step_codes = torch.cat([codes_a[..., 80 + i : 85 + i], codes_b[..., i : i + 5]])
        outs.append(decoder.decode_incremental(step_codes, state))
    joint = torch.cat(outs, dim=-1)
    stream_a = torch.cat([head, joint[:1]], dim=-1)
    assert (stream_a - decoder(codes_a)).abs().max().item() <= TOL
    assert (joint[1:] - decoder(codes_b)).abs().max().item() <= TOL
    # select() splits the batch state back: continuing stream b alone stays exact.
    state_b = state.select([1])
    more_b = _random_codes(config, batch=1, frames=3, seed=23)
    tail = decoder.decode_incremental(more_b, state_b)
    full_b = decoder(torch.cat([codes_b, more_b], dim=-1))
    assert (tail - full_b[..., 30 * SPF :]).abs().max().item() <= TOL


@torch.no_grad()
def test_decode_slots_decodes_rows_of_a_pool_and_leaves_the_others(tiny):
    """Streams whose states are rows of one pool (as the model keeps them), stepped in varying groups and
    orders, each decode to their full decode; rows no call names stay exactly as they were."""
    config, decoder, _, _ = tiny
    pool = decoder.new_state(6)
    for tensor in (*pool.keys, *pool.conv_tails):  # poison: a row's state must come from its own decodes
        tensor.normal_()
    fresh = decoder.new_state(3)
    pool.put([4, 1, 2], fresh)
    others = pool.select([0, 3, 5])  # rows no call names
    codes = {slot: _random_codes(config, batch=1, frames=40, seed=30 + slot) for slot in (4, 1, 2)}
    done = dict.fromkeys(codes, 0)
    pieces: dict[int, list[torch.Tensor]] = {slot: [] for slot in codes}
    generator = torch.Generator().manual_seed(3)
    while any(n < 40 for n in done.values()):
        group = [slot for slot in codes if done[slot] < 40 and torch.rand((), generator=generator) < 0.7]
        group = [group[i] for i in torch.randperm(len(group), generator=generator).tolist()]
        if not group:
            continue
        n = min(int(torch.randint(1, 4, (), generator=generator)), *(40 - done[slot] for slot in group))
        step = torch.cat([codes[slot][..., done[slot] : done[slot] + n] for slot in group])
        out = decoder.decode_slots(step, pool, torch.tensor(group))
        assert out.shape == (len(group), n * SPF)
        for row, slot in enumerate(group):
            pieces[slot].append(out[row : row + 1])
            done[slot] += n
    for slot in codes:
        got = torch.cat(pieces[slot], dim=-1)
        assert (got - decoder(codes[slot])).abs().max().item() <= TOL
    assert pool.positions.tolist() == [0, 40, 40, 0, 40, 0]
    for (mine, _), (theirs, _) in zip(pool.select([0, 3, 5])._tensors(), others._tensors(), strict=True):
        assert torch.equal(mine, theirs)
    with pytest.raises(ValueError, match="slots must be"):
        decoder.decode_slots(codes[4][..., :1], pool, torch.tensor([1, 2]))


def test_incremental_rejects_bad_input(tiny):
    _, decoder, codes, _ = tiny
    state = decoder.new_state(2)
    with pytest.raises(ValueError, match="at least one frame"):
        decoder.decode_incremental(codes[..., :0], state)
    with pytest.raises(ValueError, match="batch"):
        decoder.decode_incremental(codes[:1, :, :1], state)
    with pytest.raises(ValueError, match=r"\(B, 4, T\)"):
        decoder.decode_incremental(codes[:, :3, :1], state)


@pytest.mark.slow
@torch.no_grad()
def test_official_size_streaming_equals_full_decode():
    """Official 12 Hz sizes (8 layers, 1536-channel decoder); 78 frames > window 72 (~60 s on 2 cores)."""
    config = PRESETS["12hz"]
    decoder, _ = random_speech_tokenizer(config, seed=2, with_encoder=False)
    codes = _random_codes(config, batch=1, frames=78, seed=9)
    full = decoder(codes)
    assert full.std() > 0.05 and (full.abs() >= 1.0).float().mean() < 0.05
    streamed = _decode_in_pieces(decoder, codes, sizes_seed=4)
    assert (streamed - full).abs().max().item() <= TOL


@torch.no_grad()
def test_bf16_decode_tracks_fp32():
    """bf16 (the GPU dtype) runs both paths without dtype errors and stays near the fp32 decode
    (measured mean |diff| 0.008 on a 0.25-mean-amplitude signal, 2026-12-02)."""
    config = PRESETS["tiny"]
    fp32, _ = random_speech_tokenizer(config, seed=3, with_encoder=False)
    bf16, _ = random_speech_tokenizer(config, seed=3, with_encoder=False, dtype=torch.bfloat16)
    codes = _random_codes(config, batch=2, frames=30, seed=8)
    reference = fp32(codes)
    full = bf16(codes)
    state = bf16.new_state(2)
    streamed = torch.cat([bf16.decode_incremental(codes[..., i : i + 3], state) for i in range(0, 30, 3)], dim=-1)
    assert full.dtype == streamed.dtype == torch.bfloat16
    assert (full.float() - reference).abs().mean() < 0.03
    assert (streamed.float() - reference).abs().mean() < 0.03


def test_small_state_is_one_flat_buffer_gathered_and_scattered_at_once(tiny):
    """Every conv tail and overlap of a state is a view of its flat buffer, so a pool's select / put of a batch
    (rings left in place) is one index kernel for them and one for the positions; a state without the buffer (built
    by hand) still puts view by view, and cat keeps the buffer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    _, decoder, _, _ = tiny
    pool = decoder.new_state(5)
    assert pool.flat is not None and pool.flat.shape[0] == 5
    for t in (*pool.conv_tails, *pool.trans_overlaps):
        assert t.untyped_storage().data_ptr() == pool.flat.untyped_storage().data_ptr()
    assert sum(t[0].numel() for t in (*pool.conv_tails, *pool.trans_overlaps)) == pool.flat.shape[1]

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    rows = torch.tensor([3, 0])
    with Ops() as ops:
        picked = pool.select(rows, rings=False)
    assert ops.names.count("index_select") == 2  # the flat buffer and the positions
    for t in (*picked.conv_tails, *picked.trans_overlaps):  # the selected state's views are of its own buffer
        assert t.untyped_storage().data_ptr() == picked.flat.untyped_storage().data_ptr()
    picked.flat.normal_()
    with Ops() as ops:
        pool.put(rows, picked, rings=False)
    assert ops.names.count("index_copy_") == 2
    assert torch.equal(pool.conv_tails[0][3], picked.conv_tails[0][0])
    assert torch.equal(pool.trans_overlaps[-1][0], picked.trans_overlaps[-1][1])

    by_hand = DecoderState(  # no flat buffer: tensors of its own
        conv_tails=[torch.randn_like(t[:2]) for t in pool.conv_tails],
        trans_overlaps=[torch.randn_like(t[:2]) for t in pool.trans_overlaps],
        keys=pool.keys[:, :2].clone(),
        values=pool.values[:, :2].clone(),
        positions=torch.tensor([7, 9]),
    )
    pool.put(torch.tensor([1, 4]), by_hand)
    assert torch.equal(pool.conv_tails[2][4], by_hand.conv_tails[2][1]) and pool.positions[[1, 4]].tolist() == [7, 9]
    both = DecoderState.cat([decoder.new_state(1), pool.select([1, 4])])
    assert both.flat.shape == (3, pool.flat.shape[1]) and torch.equal(both.conv_tails[2][2], by_hand.conv_tails[2][1])
