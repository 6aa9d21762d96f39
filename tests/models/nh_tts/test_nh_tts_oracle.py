"""NH-TTS against transformers' DiaForConditionalGeneration and DacModel (4.57) on tiny seeded checkpoints
saved in the Hugging Face layout and loaded by tilevox: encoder outputs, per-step logits of all channels and
both guidance rows, greedy and sampled codes of generate() (delay pattern applied and undone), the decoded
waveform, voice cloning from an audio prompt, and a batch of two streams of different text lengths."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.models.nh_tts.nh_reference import (
    decoder_inputs,
    encoder_inputs,
    make_reference,
    prompt_decoder_inputs,
    revert_delay,
)
from tilevox.models.nh_tts.loader import load_checkpoint
from tilevox.models.nh_tts.tokenizer import encode_text
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import FinishReason, SynthesisRequest, VoicePrompt

pytestmark = pytest.mark.oracle

TOL = 1e-4
TEXT_A = "[S1] Hello there, friend."
TEXT_B = "[S1] A much longer line of text, [S2] with a second speaker in it."


def _reference(tmp_path, shape, *, seed, guidance, top_k, eos_like=None, sample=False):
    ref = make_reference(tmp_path, shape, seed=seed, eos_like=eos_like)
    gen = ref.model.generation_config
    gen.guidance_scale, gen.top_k, gen.do_sample = guidance, top_k, sample
    gen.temperature, gen.top_p = (1.2, 0.95) if sample else (1.0, 1.0)
    # As transformers' Dia conversion writes it (GenerationConfig refuses to save top_k without sampling).
    fields = {"do_sample": sample, "guidance_scale": guidance, "top_k": top_k}
    fields |= {"temperature": gen.temperature, "top_p": gen.top_p}
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    return ref


def _hf_generate(ref, texts, max_new, **kw):
    ids, mask = encoder_inputs(texts)
    dids, dmask = decoder_inputs(ref.config, len(texts))
    return ref.model.generate(
        input_ids=ids,
        attention_mask=mask,
        decoder_input_ids=dids,
        decoder_attention_mask=dmask,
        max_new_tokens=max_new,
        **kw,
    )


def _run(model, requests, *, together=True):
    """Open (one batched open_streams) and step the streams; per stream: picked positions (L, C), audio, reason."""
    picked: dict[int, dict[int, torch.Tensor]] = {}
    model.code_observer = lambda sid, pos, codes: picked.setdefault(sid, {}).__setitem__(pos, codes.clone())
    ids = model.open_streams(requests) if together else [model.open_stream(r) for r in requests]
    assert all(isinstance(i, int) for i in ids), ids
    audio = {i: [] for i in ids}
    reasons = {}
    live = list(ids)
    while live:
        for chunk in model.step(live):
            audio[chunk.stream_id].append(chunk.samples)
            if chunk.is_finished:
                reasons[chunk.stream_id] = chunk.finish_reason
                live.remove(chunk.stream_id)
    out = []
    for i in ids:
        seq = torch.stack([picked[i][p] for p in sorted(picked[i])])
        out.append((seq, np.concatenate(audio[i]), reasons[i]))
    return out


def _frames_for(max_new: int, ref) -> int:
    """tilevox's frame budget (max_new_tokens) equivalent to transformers' max_new_tokens: the delay tail and
    the EOS position are positions without a frame of their own."""
    return max_new - max(ref.config.delay_pattern) - 1


@pytest.mark.parametrize("shape, seed", [("a", 3), ("b", 11)])
def test_encoder_outputs_equal_transformers(tmp_path, shape, seed):
    ref = make_reference(tmp_path, shape, seed=seed)
    model = load_checkpoint(tmp_path, device="cpu", dtype=torch.float32, max_streams=2)
    texts = [TEXT_B, TEXT_A, "x"]  # right padding with a one-byte row
    ids, mask = encoder_inputs(texts)
    assert [encode_text(t) for t in texts] == [row[: int(m.sum())].tolist() for row, m in zip(ids, mask)]
    with torch.no_grad():
        want = ref.model.model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        got = model.network.encode_text(ids, mask.bool())
        for b in range(len(texts)):  # each text alone, unpadded, equals its padded row
            n = int(mask[b].sum())
            alone = model.network.encode_text(ids[b : b + 1, :n], mask[b : b + 1, :n].bool())
            torch.testing.assert_close(alone[0], want[b, :n], atol=TOL, rtol=0)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=TOL, rtol=0)


@pytest.mark.parametrize("shape, seed, guidance", [("a", 3, 3.0), ("b", 11, 1.0)])
def test_step_logits_of_every_channel_equal_transformers_over_30_steps(tmp_path, shape, seed, guidance):
    ref = _reference(tmp_path, shape, seed=seed, guidance=guidance, top_k=5)
    model = load_checkpoint(tmp_path, device="cpu", dtype=torch.float32, max_streams=2)
    assert model.rows_per_stream == (2 if guidance != 1.0 else 1)
    # The head's raw outputs, captured by a hook (generate's output_logits are edited in place by the EOS filter
    # when no guidance processor copies them first).
    raw: list[torch.Tensor] = []
    hook = ref.model.logits_dense.register_forward_hook(lambda mod, args, out: raw.append(out[:, -1].clone()))
    try:
        out = _hf_generate(ref, [TEXT_A], 30, do_sample=False, return_dict_in_generate=True)
    finally:
        hook.remove()
    assert len(raw) == 30
    channels, vocab = 9, 1028
    # Teacher-force transformers' own delayed positions through tilevox's decoder, both guidance rows.
    sequence = out.sequences[0]  # (L, C), delay mask applied
    ids, mask = encoder_inputs([TEXT_A])
    rows = list(range(model.rows_per_stream))
    cache = model.network.new_cache(max_rows=len(rows), max_seq_len=64, max_text_len=64)
    cache.claim(rows)
    ids_rows = torch.cat([ids, torch.zeros_like(ids)])[: len(rows)]
    encoded = model.network.encode_text(ids_rows, mask.bool().expand(len(rows), -1))
    model.network.decoder.write_cross(cache, rows, encoded, mask.bool().expand(len(rows), -1))
    for step in range(30):
        codes = sequence[step][None, None].expand(len(rows), 1, channels)
        got = model.network.step(cache, rows, codes)  # (rows, C, V)
        want = raw[step].view(len(rows), channels, vocab)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "shape, seed, guidance, top_k, eos_like, reason",
    [
        ("a", 3, 3.0, 5, 22, FinishReason.STOP),  # channel 0 ends by itself at position 10
        ("b", 11, 1.0, 50, None, FinishReason.LENGTH),  # no guidance; EOS forced by the length limit
    ],
)
def test_greedy_codes_and_waveform_equal_transformers(tmp_path, shape, seed, guidance, top_k, eos_like, reason):
    ref = _reference(tmp_path, shape, seed=seed, guidance=guidance, top_k=top_k, eos_like=eos_like)
    model = load_checkpoint(tmp_path, device="cpu", dtype=torch.float32, max_streams=2)
    max_new = 30
    want = _hf_generate(ref, [TEXT_A], max_new, do_sample=False)[0]  # (L, C), delay applied
    budget = _frames_for(max_new, ref)
    request = SynthesisRequest(
        text=TEXT_A, sampling=SamplingParams(temperature=0.0, top_k=top_k, max_new_tokens=budget)
    )
    ((seq, audio, got_reason),) = _run(model, [request])
    assert got_reason is reason
    # tilevox picks positions 1 .. e - 1 + max_delay (the last position transformers adds is forced EOS/PAD).
    torch.testing.assert_close(seq, want[1 : 1 + seq.shape[0]], rtol=0, atol=0)
    eos = int((want[:, 0] == ref.config.eos_token_id).nonzero()[0, 0])
    assert seq.shape[0] == eos - 1 + max(ref.config.delay_pattern)
    assert want.shape[0] == eos + max(ref.config.delay_pattern) + 1
    # Delay undone as DiaProcessor.batch_decode does: frames 1 .. eos - 1.
    frames = revert_delay(ref.config, want[None])[0][:, 1:eos]  # (C, F)
    assert frames.shape[1] == (budget if reason is FinishReason.LENGTH else eos - 1)
    with torch.no_grad():
        wave = ref.dac.decode(audio_codes=frames[None].long()).audio_values[0]
    assert audio.shape == wave.shape
    np.testing.assert_allclose(audio, wave.numpy(), atol=TOL, rtol=0)


def test_sampled_codes_equal_transformers_draw_for_draw(tmp_path):
    """Bitwise: one stream's generator draws its 9 channels in one multinomial call, as transformers draws the
    rows of a batch of one from the global generator seeded the same; guidance 3, top-k 45, top-p 0.95, T 1.2."""
    ref = _reference(tmp_path, "a", seed=5, guidance=3.0, top_k=45, sample=True)
    model = load_checkpoint(tmp_path, device="cpu", dtype=torch.float32, max_streams=2)
    assert not model.default_sampling.is_greedy and model.default_sampling.top_k == 45
    max_new, seed = 30, 1234
    torch.manual_seed(seed)
    want = _hf_generate(ref, [TEXT_A], max_new)[0]
    sampling = SamplingParams(temperature=1.2, top_k=45, top_p=0.95, max_new_tokens=_frames_for(max_new, ref))
    ((seq, _, _),) = _run(model, [SynthesisRequest(text=TEXT_A, sampling=sampling, seed=seed)])
    torch.testing.assert_close(seq, want[1 : 1 + seq.shape[0]], rtol=0, atol=0)
    # ... and the same draws when another stream shares the steps.
    other = SynthesisRequest(text=TEXT_B, sampling=sampling, seed=seed + 1)
    (seq2, _, _), _ = _run(model, [SynthesisRequest(text=TEXT_A, sampling=sampling, seed=seed), other])
    torch.testing.assert_close(seq2, seq, rtol=0, atol=0)


def test_batch_of_two_streams_of_different_text_lengths_equals_each_alone(tmp_path):
    ref = _reference(tmp_path, "a", seed=3, guidance=3.0, top_k=5, eos_like=22)
    model = load_checkpoint(tmp_path, device="cpu", dtype=torch.float32, max_streams=3)
    max_new = 30
    budget = _frames_for(max_new, ref)
    requests = [
        SynthesisRequest(text=t, sampling=SamplingParams(temperature=0.0, top_k=5, max_new_tokens=budget))
        for t in (TEXT_A, TEXT_B)
    ]
    together = _run(model, requests)
    alone = [_run(model, [r])[0] for r in requests]
    want = _hf_generate(ref, [TEXT_A, TEXT_B], max_new, do_sample=False)  # transformers' padded batch
    for (seq, audio, reason), (seq1, audio1, reason1), row in zip(together, alone, want):
        assert reason is reason1
        torch.testing.assert_close(seq, seq1, rtol=0, atol=0)
        np.testing.assert_allclose(audio, audio1, atol=1e-5, rtol=0)
        torch.testing.assert_close(seq, row[1 : 1 + seq.shape[0]], rtol=0, atol=0)
    assert together[0][0].shape != together[1][0].shape or not torch.equal(together[0][0], together[1][0])


def test_voice_cloning_from_an_audio_prompt_equals_transformers(tmp_path):
    ref = _reference(tmp_path, "a", seed=7, guidance=3.0, top_k=5)
    model = load_checkpoint(tmp_path, device="cpu", dtype=torch.float32, max_streams=2)
    rng = np.random.default_rng(0)
    hop = ref.dac.config.hop_length
    prompt = (0.3 * rng.standard_normal(5 * hop + 100)).astype(np.float32)  # 5.2 frames: padded to 6
    transcript, text = "[S1] The prompt's words.", "[S1] And what comes next."
    # The DAC encoder as DiaProcessor runs it: the audio zero-padded to whole frames.
    padded = np.zeros(6 * hop, dtype=np.float32)
    padded[: prompt.size] = prompt
    with torch.no_grad():
        want_codes = ref.dac.encode(torch.from_numpy(padded)[None, None]).audio_codes[0].T  # (T, C)
    got_codes = model.encode_prompt_audio(prompt)
    torch.testing.assert_close(got_codes, want_codes, rtol=0, atol=0)

    max_new = 30
    ids, mask = encoder_inputs([transcript + " " + text])
    dids, dmask = prompt_decoder_inputs(ref.config, want_codes)
    want = ref.model.generate(
        input_ids=ids,
        attention_mask=mask,
        decoder_input_ids=dids,
        decoder_attention_mask=dmask,
        max_new_tokens=max_new,
        do_sample=False,
    )[0]
    prompt_len = 1 + want_codes.shape[0]
    request = SynthesisRequest(
        text=text,
        voice_prompt=VoicePrompt(samples=prompt, sample_rate_hz=44100, transcript=transcript),
        sampling=SamplingParams(temperature=0.0, top_k=5, max_new_tokens=_frames_for(max_new, ref)),
    )
    ((seq, audio, reason),) = _run(model, [request])
    assert reason is FinishReason.LENGTH
    torch.testing.assert_close(seq, want[prompt_len : prompt_len + seq.shape[0]], rtol=0, atol=0)
    eos = int((want[:, 0] == ref.config.eos_token_id).nonzero()[0, 0])
    frames = revert_delay(ref.config, want[None])[0][:, prompt_len:eos]  # the generated audio only
    with torch.no_grad():
        wave = ref.dac.decode(audio_codes=frames[None].long()).audio_values[0]
    np.testing.assert_allclose(audio, wave.numpy(), atol=TOL, rtol=0)
