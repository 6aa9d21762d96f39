"""Streaming decode: chunked equals full within STREAM_MAX_ABS_ERROR, batched streams equal lone ones,
and the decoder's reach (what makes windows exact) is exactly what `decoder_reach_frames` says."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.dac.conftest import TINY
from tilevox.models.dac import DacConfig, DacStreamDecoder, decoder_reach_frames, push_many, random_dac
from tilevox.models.dac.streaming import STREAM_MAX_ABS_ERROR

PUSH_SIZES = (1, 3, 2, 7, 13)


def _codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, TINY.codebook_size, (TINY.n_codebooks, frames), generator=torch.Generator().manual_seed(seed)
    )


def _stream(stream: DacStreamDecoder, codes: torch.Tensor, sizes=PUSH_SIZES) -> np.ndarray:
    pieces, pos, index = [], 0, 0
    while pos < codes.shape[1]:
        size = sizes[index % len(sizes)]
        pieces.append(stream.push(codes[:, pos : pos + size]))
        pos, index = pos + size, index + 1
    pieces.append(stream.flush())
    return np.concatenate([p for p in pieces if p is not None])


def _full(codec, codes: torch.Tensor) -> np.ndarray:
    with torch.inference_mode():
        return codec.decode(codes[None])[0].numpy()


@pytest.mark.parametrize("frames", [1, 7, 33, 101])
@pytest.mark.parametrize("chunk_frames", [1, 8])
def test_streamed_equals_full_decode(tiny_codec, frames, chunk_frames):
    codes = _codes(frames, seed=frames)
    streamed = _stream(DacStreamDecoder(tiny_codec, chunk_frames=chunk_frames), codes)
    full = _full(tiny_codec, codes)
    assert streamed.shape == full.shape == (frames * 512,) and streamed.dtype == np.float32
    assert np.abs(streamed - full).max() <= STREAM_MAX_ABS_ERROR


def test_push_sizes_do_not_change_the_audio(tiny_codec):
    """Same windows whatever the push sizes; one big push decodes its blocks as one batch, which only
    rounds differently."""
    codes = _codes(45, seed=1)
    one_by_one = _stream(DacStreamDecoder(tiny_codec), codes, sizes=(1,))
    all_at_once = _stream(DacStreamDecoder(tiny_codec), codes, sizes=(45,))
    np.testing.assert_allclose(one_by_one, all_at_once, rtol=0, atol=1e-5)


def test_short_context_is_not_exact(tiny_codec):
    """The bound is not vacuous: windows narrower than the reach do change the audio."""
    codes = _codes(60, seed=2)
    narrow = _stream(DacStreamDecoder(tiny_codec, left_context=2, lookahead=2), codes)
    assert np.abs(narrow - _full(tiny_codec, codes)).max() > 100 * STREAM_MAX_ABS_ERROR


def test_first_audio_and_latency(tiny_codec):
    stream = DacStreamDecoder(tiny_codec)
    assert (stream.left_context, stream.lookahead, stream.chunk_frames) == (10, 10, 8)
    assert stream.first_audio_frames == 18
    assert stream.latency_ms == pytest.approx(17 * 512 / 44.1)
    codes = _codes(18, seed=3)
    assert stream.push(codes[:, :17]) is None
    first = stream.push(codes[:, 17:])
    assert first is not None and first.shape == (8 * 512,)
    assert stream.num_emitted_frames == 8 and stream.num_frames == 18


def test_batched_streams_equal_lone_streams(tiny_codec):
    """Streams of different lengths and push patterns advanced together equal each alone; the padding
    of shorter windows is poisoned with junk codes by pushing longer streams first."""
    lengths, push_patterns = (5, 29, 64, 101), ((5,), (1, 4), (9, 2, 30), (17, 3))
    codes = [_codes(n, seed=10 + n) for n in lengths]
    alone = [_stream(DacStreamDecoder(tiny_codec), c, sizes=p) for c, p in zip(codes, push_patterns, strict=True)]
    streams = [DacStreamDecoder(tiny_codec) for _ in lengths]
    positions, steps, pieces = [0] * len(lengths), [0] * len(lengths), [[] for _ in lengths]
    while any(pos < n for pos, n in zip(positions, lengths, strict=True)):
        rows = [i for i, n in enumerate(lengths) if positions[i] < n]
        batch = []
        for i in rows:
            size = push_patterns[i][steps[i] % len(push_patterns[i])]
            batch.append(codes[i][:, positions[i] : positions[i] + size])
            positions[i], steps[i] = positions[i] + size, steps[i] + 1
        for i, out in zip(rows, push_many([streams[i] for i in rows], batch), strict=True):
            pieces[i].append(out)
    for i, stream in enumerate(streams):
        together = np.concatenate([p for p in pieces[i] + [stream.flush()] if p is not None])
        np.testing.assert_allclose(together, alone[i], rtol=0, atol=STREAM_MAX_ABS_ERROR)


def test_decode_windows_masks_junk_padding(tiny_codec):
    gen = torch.Generator().manual_seed(4)
    lengths = torch.tensor([30, 7, 19])
    junk = torch.randint(0, 1024, (3, 9, 30), generator=gen)
    real = [_codes(int(n), seed=20 + i) for i, n in enumerate(lengths)]
    padded = junk.clone()
    for row, codes in enumerate(real):
        padded[row, :, : codes.shape[1]] = codes
    padded[1, :, 7:] = -5  # padding need not even be a valid code
    with torch.inference_mode():
        batched = tiny_codec.decode_windows(padded, lengths)
    for row, codes in enumerate(real):
        samples = codes.shape[1] * 512
        np.testing.assert_allclose(batched[row, :samples].numpy(), _full(tiny_codec, codes), rtol=0, atol=1e-5)
        assert not batched[row, samples:].any()


def test_reach_is_exact():
    """Changing one frame's codes changes exactly the samples of frames within the reach (float64, so
    a zero difference is a true zero): the analytic reach is neither too small nor loose."""
    config = DacConfig(
        encoder_hidden_size=2, downsampling_ratios=(2, 4), decoder_hidden_size=16, n_codebooks=2,
        codebook_size=16, codebook_dim=4, sampling_rate=8000,
    )  # fmt: skip
    codec = random_dac(config, seed=0, dtype=torch.float64)
    codes = torch.randint(0, 16, (1, 2, 80), generator=torch.Generator().manual_seed(0))
    changed = codes.clone()
    changed[0, :, 40] = (codes[0, :, 40] + 1) % 16
    with torch.inference_mode():
        diff = (codec.decode(changed) - codec.decode(codes))[0].abs().reshape(80, config.hop_length).amax(dim=1)
    touched = torch.nonzero(diff > 0).flatten()
    left, right = decoder_reach_frames(config)
    # Frame f's samples read frames f - left .. f + right, so frame 40 reaches frames 40 - right .. 40 + left.
    assert (int(touched.min()), int(touched.max())) == (40 - right, 40 + left)


def test_misuse_is_refused(tiny_codec):
    stream = DacStreamDecoder(tiny_codec)
    with pytest.raises(ValueError, match=r"int64 \(9, frames\)"):
        stream.push(torch.zeros(9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 1024\)"):
        stream.push(torch.full((9, 2), 1024))
    stream.flush()
    with pytest.raises(ValueError, match="push after flush"):
        stream.push(_codes(1, seed=0))
    with pytest.raises(ValueError, match="flush called twice"):
        stream.flush()
    with pytest.raises(ValueError, match="chunk_frames"):
        DacStreamDecoder(tiny_codec, chunk_frames=0)
