"""Streaming the official chunked decode (issue 11: long Qwen3-TTS audio).

The official decode() decodes in 300-frame chunks with 25 frames of left context, so audio past
frame 300 (24 s) differs from an exact decode. `decode_incremental_chunked` streams that decode:
checked against the official package (tiny random speech tokenizer, CPU, 345 frames, several
push patterns), and `ModelOptions(decode_mode="official_chunked")` wires it into the model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tilevox.models.qwen3_tts.loader import load_preset
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.qwen3_tts.speech_tokenizer import load_speech_tokenizer
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest

TOL = 1e-4
FRAMES = 345


def _codes(frames: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (1, 4, frames), generator=generator)


def _stream(decoder, codes: torch.Tensor, pushes: list[int], **chunking) -> torch.Tensor:
    state = decoder.new_chunked_state(1, **chunking)
    pieces, pos, i = [], 0, 0
    while pos < codes.shape[-1]:
        n = pushes[i % len(pushes)]
        pieces.append(decoder.decode_incremental_chunked(codes[..., pos : pos + n], state))
        pos, i = pos + n, i + 1
    return torch.cat(pieces, dim=-1)


@pytest.mark.oracle
@pytest.mark.parametrize("pushes", [[1], [7, 1, 30], [FRAMES], [275, 25, 1, 299]], ids=str)
@torch.no_grad()
def test_streamed_chunked_decode_matches_official_decode(official_speech_tokenizer, pushes):
    folder, official = official_speech_tokenizer
    _, decoder, _ = load_speech_tokenizer(folder, with_encoder=False)
    codes = _codes(FRAMES, seed=11)
    expected = official.decode(codes.transpose(1, 2), return_dict=True).audio_values[0]
    got = _stream(decoder, codes, pushes)[0]
    assert got.shape == expected.shape == (FRAMES * 1920,)
    assert (got - expected).abs().max().item() <= TOL
    # Past frame 300 the exact decode differs from the official one (so this test can fail) ...
    exact = decoder(codes)[0]
    assert (exact[300 * 1920 :] - expected[300 * 1920 :]).abs().max().item() > 1e-3
    # ... and before it, both are the same decode.
    assert (exact[: 300 * 1920] - expected[: 300 * 1920]).abs().max().item() <= TOL


@torch.no_grad()
def test_chunked_stream_other_chunkings_and_validation():
    from tilevox.models.qwen3_tts.speech_tokenizer import PRESETS, random_speech_tokenizer

    decoder, _ = random_speech_tokenizer(PRESETS["tiny"], seed=5, with_encoder=False)
    codes = _codes(95, seed=2)
    for chunk, context in ((20, 0), (20, 7), (30, 29)):
        expected = decoder.chunked_decode(codes, chunk=chunk, left_context=context)
        got = _stream(decoder, codes, [3, 1, 11], chunk_frames=chunk, left_context_frames=context)
        assert (got - expected).abs().max().item() <= TOL, (chunk, context)
    with pytest.raises(ValueError, match="chunk_frames > left_context_frames"):
        decoder.new_chunked_state(1, chunk_frames=25, left_context_frames=25)


@torch.no_grad()
def test_model_official_chunked_mode_streams_the_official_decode():
    """Over 340 frames the model's audio in official_chunked mode equals chunked_decode of the frames
    it emitted (checked against the official package above), and exact mode equals a full decode."""
    request = SynthesisRequest(
        text="A long one.",
        voice="aiden",
        sampling=SamplingParams.greedy(max_new_tokens=FRAMES + 1),
        seed=3,
        max_duration_s=60.0,
    )
    audio, frames = {}, {}
    for mode in ("exact", "official_chunked"):
        model = load_preset(
            "qwen3-tts-tiny",
            options=ModelOptions(max_streams=1, max_seq_len=512, decode_mode=mode, audio_every_frames=4),
        )
        model._suppress[model.config.talker.codec_eos_token_id] = True  # never stop early: reach FRAMES frames
        emitted = []
        model.frame_observer = lambda sid, codes, emitted=emitted: emitted.append(codes)
        stream = model.open_stream(request)
        pieces = []
        while True:
            (chunk,) = model.step([stream])
            pieces.append(chunk.samples)
            if chunk.is_finished:
                break
        audio[mode], frames[mode] = np.concatenate(pieces), torch.stack(emitted, dim=1)[None]
    assert torch.equal(frames["exact"], frames["official_chunked"]) and frames["exact"].shape[-1] == FRAMES
    decoder = model.codec_decoder
    chunked = decoder.chunked_decode(frames["exact"])[0].numpy()
    exact = decoder(frames["exact"])[0].numpy()
    assert np.abs(audio["official_chunked"] - chunked).max() <= TOL
    assert np.abs(audio["exact"] - exact).max() <= TOL
    assert np.abs(audio["official_chunked"] - audio["exact"]).max() > 1e-3
    with pytest.raises(ValueError, match="decode_mode must be one of"):
        ModelOptions(decode_mode="chunked")
