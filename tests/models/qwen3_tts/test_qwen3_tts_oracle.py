"""Parity with the official qwen-tts==0.1.1 on tiny checkpoints (CPU, fp32, greedy, batch of 2).

For CustomVoice (both text layouts, with and without instructions), VoiceDesign and Base
(x-vector and ICL): each case runs a batch of a short and a long prompt through the official
wrapper (left-padded batch) and the same two requests as concurrent streams here, then compares
per-step talker logits (forward hook on talker.codec_head), all code-predictor logits (hooks on
code_predictor.lm_head[i]), the emitted codes, the prefill embeddings and the final waveform.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from oracle_checkpoints import load_official

from tilevox.models.qwen3_tts.loader import load_checkpoint
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.qwen3_tts.prompt import TextLayout, build_layout, embed_layout
from tilevox.models.sampling import SamplingParams, apply_repetition_penalty
from tilevox.models.streaming import SynthesisRequest, VoicePrompt

pytestmark = pytest.mark.oracle

MAX_NEW_TOKENS = 20
LOGIT_TOL = 1e-4
WAVE_TOL = 1e-4
SHORT = "Hi."
LONG = "A much longer sentence, with punctuation & numbers 42!"


def _reference_audio(num_samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / 24000.0
    wav = 0.3 * np.sin(2 * np.pi * (180 + 40 * seed) * t) + 0.05 * rng.standard_normal(num_samples)
    return wav.astype(np.float32)


REF_AUDIO = [_reference_audio(31_000, 1), _reference_audio(48_000, 2)]  # 1.29 s (partial frame), 2 s
REF_TEXT = ["Reference one.", "The second reference transcript is longer."]


@dataclass(frozen=True)
class Case:
    kind: str  # checkpoint folder
    method: str  # official wrapper method
    official_kwargs: dict
    requests: tuple[SynthesisRequest, ...]
    layout: TextLayout | None = None
    has_speaker_vector: bool = False
    eos_probe: bool = False  # tilt the EOS row of codec_head so one stream stops early (STOP path)


def _greedy() -> SamplingParams:
    # repetition_penalty as the checkpoint's generation_config (the official wrapper uses it too)
    return SamplingParams.greedy(max_new_tokens=MAX_NEW_TOKENS, repetition_penalty=1.05)


def _req(text: str, **kw) -> SynthesisRequest:
    return SynthesisRequest(text=text, sampling=_greedy(), **kw)


CASES = {
    "custom_voice": Case(
        kind="custom_voice",
        method="generate_custom_voice",
        official_kwargs=dict(text=[SHORT, LONG], speaker=["aiden", "dylan"], language=["english", "auto"]),
        requests=(_req(SHORT, voice="aiden", language="english"), _req(LONG, voice="dylan")),
    ),
    "custom_voice_streaming_text_instruct": Case(
        kind="custom_voice",
        method="generate_custom_voice",
        official_kwargs=dict(
            text=[LONG, SHORT],
            speaker=["dylan", "aiden"],
            language=["chinese", "english"],
            instruct=["Speak slowly.", ""],
            non_streaming_mode=False,
        ),
        requests=(
            _req(LONG, voice="dylan", language="chinese", instructions="Speak slowly."),
            _req(SHORT, voice="aiden", language="english"),
        ),
        layout=TextLayout.STREAMING,
    ),
    "custom_voice_eos": Case(
        kind="custom_voice",
        method="generate_custom_voice",
        official_kwargs=dict(text=[SHORT, LONG], speaker=["aiden", "dylan"], language=["english", "auto"]),
        requests=(_req(SHORT, voice="aiden", language="english"), _req(LONG, voice="dylan")),
        eos_probe=True,
    ),
    "voice_design": Case(
        kind="voice_design",
        method="generate_voice_design",
        official_kwargs=dict(
            text=[SHORT, LONG], instruct=["A calm, low voice.", "Bright and fast."], language=["english", "auto"]
        ),
        requests=(
            _req(SHORT, language="english", instructions="A calm, low voice."),
            _req(LONG, instructions="Bright and fast."),
        ),
    ),
    "base_xvector": Case(
        kind="base",
        method="generate_voice_clone",
        official_kwargs=dict(
            text=[SHORT, LONG],
            language=["english", "auto"],
            ref_audio=[(a, 24000) for a in REF_AUDIO],
            x_vector_only_mode=True,
        ),
        requests=(
            _req(SHORT, language="english", voice_prompt=VoicePrompt(samples=REF_AUDIO[0], sample_rate_hz=24000)),
            _req(LONG, voice_prompt=VoicePrompt(samples=REF_AUDIO[1], sample_rate_hz=24000)),
        ),
        has_speaker_vector=True,
    ),
    "base_icl": Case(
        kind="base",
        method="generate_voice_clone",
        official_kwargs=dict(
            text=[SHORT, LONG],
            language=["english", "auto"],
            ref_audio=[(a, 24000) for a in REF_AUDIO],
            ref_text=REF_TEXT,
            x_vector_only_mode=False,
        ),
        requests=(
            _req(
                SHORT,
                language="english",
                voice_prompt=VoicePrompt(samples=REF_AUDIO[0], sample_rate_hz=24000, transcript=REF_TEXT[0]),
            ),
            _req(LONG, voice_prompt=VoicePrompt(samples=REF_AUDIO[1], sample_rate_hz=24000, transcript=REF_TEXT[1])),
        ),
        has_speaker_vector=True,
    ),
    "base_icl_non_streaming_text": Case(
        kind="base",
        method="generate_voice_clone",
        official_kwargs=dict(
            text=[LONG, SHORT],
            language=["auto", "chinese"],
            ref_audio=[(a, 24000) for a in REF_AUDIO],
            ref_text=REF_TEXT,
            x_vector_only_mode=False,
            non_streaming_mode=True,
        ),
        requests=(
            _req(LONG, voice_prompt=VoicePrompt(samples=REF_AUDIO[0], sample_rate_hz=24000, transcript=REF_TEXT[0])),
            _req(
                SHORT,
                language="chinese",
                voice_prompt=VoicePrompt(samples=REF_AUDIO[1], sample_rate_hz=24000, transcript=REF_TEXT[1]),
            ),
        ),
        layout=TextLayout.NON_STREAMING,
        has_speaker_vector=True,
    ),
}


@dataclass
class OfficialRun:
    talker_logits: list[torch.Tensor] = field(default_factory=list)  # per step (B, V)
    predictor_logits: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    prefill: list[torch.Tensor] = field(default_factory=list)  # (B, P, H), left padded
    codes: list[torch.Tensor] = field(default_factory=list)  # per row (n, Q)
    wavs: list[np.ndarray] = field(default_factory=list)
    ref_codes: list[torch.Tensor] = field(default_factory=list)


def _run_official(path, case: Case, eos_row: torch.Tensor | None = None) -> OfficialRun:
    tts = load_official(path)
    talker = tts.model.talker
    if eos_row is not None:
        with torch.no_grad():
            talker.codec_head.weight[talker.config.codec_eos_token_id] = eos_row
    run = OfficialRun()
    talker.codec_head.register_forward_hook(lambda m, i, o: run.talker_logits.append(o[:, -1].detach().clone()))
    for head_idx, head in enumerate(talker.code_predictor.lm_head):
        head.register_forward_hook(
            lambda m, i, o, head_idx=head_idx: run.predictor_logits[head_idx].append(o[:, -1].detach().clone())
        )

    def grab_prefill(module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        if embeds is not None and embeds.shape[1] > 1:
            run.prefill.append(embeds.detach().clone())

    talker.model.register_forward_pre_hook(grab_prefill, with_kwargs=True)
    generate = tts.model.generate

    def recording_generate(*args, **kwargs):
        codes, hiddens = generate(*args, **kwargs)
        run.codes.extend(c.clone() for c in codes)
        prompt = kwargs.get("voice_clone_prompt")
        if prompt is not None and prompt.get("ref_code") is not None:
            run.ref_codes.extend(prompt["ref_code"])
        return codes, hiddens

    tts.model.generate = recording_generate
    kwargs = dict(case.official_kwargs)
    if "ref_audio" in kwargs:
        # Encode each reference alone, as a streaming server sees it: upstream's batched encode
        # zero-pads shorter clips to the longest, which changes the codes of their last partial
        # frame (measured: frame 16 of the 31,000-sample clip), so batch composition would leak in.
        ref_texts = kwargs.pop("ref_text", [None] * len(kwargs["ref_audio"]))
        items = []
        for audio, ref_text in zip(kwargs.pop("ref_audio"), ref_texts):
            items += tts.create_voice_clone_prompt(
                ref_audio=audio, ref_text=ref_text, x_vector_only_mode=kwargs["x_vector_only_mode"]
            )
        kwargs.pop("x_vector_only_mode")
        kwargs["voice_clone_prompt"] = items
    wavs, sample_rate = getattr(tts, case.method)(
        **kwargs, do_sample=False, subtalker_dosample=False, max_new_tokens=MAX_NEW_TOKENS
    )
    assert sample_rate == 24000
    run.wavs = list(wavs)
    return run


@dataclass
class OurRun:
    talker_logits: dict[int, list[torch.Tensor]]
    predictor_logits: dict[tuple[int, int], list[torch.Tensor]]
    frames: dict[int, list[torch.Tensor]]
    audio: dict[int, np.ndarray]
    stream_ids: list[int]


def _run_ours(model, case: Case) -> OurRun:
    talker_logits: dict[int, list] = defaultdict(list)
    predictor_logits: dict[tuple[int, int], list] = defaultdict(list)
    frames: dict[int, list] = defaultdict(list)

    def observe(kind, ids, head, logits):
        for row, sid in enumerate(ids):
            if kind == "talker":
                talker_logits[sid].append(logits[row])
            else:
                predictor_logits[(sid, head)].append(logits[row])

    model.logit_observer = observe
    model.frame_observer = lambda sid, codes: frames[sid].append(codes)
    stream_ids = [model.open_stream(r) for r in case.requests]
    pieces: dict[int, list[np.ndarray]] = {sid: [] for sid in stream_ids}
    active = list(stream_ids)
    while active:
        for chunk in model.step(active):
            pieces[chunk.stream_id].append(chunk.samples)
            if chunk.is_finished:
                active.remove(chunk.stream_id)
    audio = {sid: np.concatenate(p) for sid, p in pieces.items()}
    return OurRun(talker_logits, predictor_logits, frames, audio, stream_ids)


@pytest.fixture(scope="module")
def loaded(oracle_checkpoints):
    cache = {}

    def get(kind: str, layout: TextLayout | None):
        key = (kind, layout)
        if key not in cache:
            cache[key] = load_checkpoint(
                oracle_checkpoints[kind],
                device="cpu",
                dtype=torch.float32,
                options=ModelOptions(max_streams=4, max_seq_len=512, text_layout=layout),
            )
        return cache[key]

    return get


def _tilt_eos(model, case: Case) -> torch.Tensor:
    """Pick an EOS row for codec_head that makes a stream stop (EOS) after 3+ frames but before
    the token limit, so the parity run covers STOP next to LENGTH. The row is alpha times the row
    of some audio code t, so the EOS logit is alpha * logit[t]; changing only the EOS row leaves
    every other logit and hence the greedy path unchanged until EOS wins, so one probe run tells
    for each (t, alpha) where each stream stops. Returns the row (also written into `model`)."""
    probe = _run_ours(model, case)
    eos = model.config.talker.codec_eos_token_id
    allowed = ~model._suppress
    allowed[eos] = False
    margin = 1e-3
    for sid in probe.stream_ids:
        tokens = [int(f[0]) for f in probe.frames[sid]]
        steps = probe.talker_logits[sid][: len(tokens)]
        best = torch.tensor(
            [  # per step: the greedy winner's processed logit (EOS aside)
                float(
                    apply_repetition_penalty(lg.float(), torch.tensor(tokens[:k], dtype=torch.long), 1.05)
                    .masked_fill(~allowed, float("-inf"))
                    .max()
                )
                for k, lg in enumerate(steps)
            ]
        )
        for target in allowed.nonzero().flatten().tolist():
            score = torch.stack([lg[target].float() for lg in steps])
            for k in range(3, len(tokens) - 1):
                if score[k] <= 0:
                    continue
                alpha = float(best[k] + 2 * margin) / float(score[k])
                # EOS is blocked for the first 2 tokens; it must lose clearly at steps 2..k-1.
                if all(alpha * score[j] < best[j] - margin for j in range(2, k)):
                    row = alpha * model.talker.codec_head.weight[target].detach().clone()
                    with torch.no_grad():
                        model.talker.codec_head.weight[eos] = row
                    return row
    raise AssertionError("no EOS tilt makes a stream stop early in this probe")


@pytest.mark.parametrize("case_name", list(CASES))
def test_matches_official(case_name, oracle_checkpoints, loaded):
    case = CASES[case_name]
    if case.eos_probe:
        model = load_checkpoint(oracle_checkpoints[case.kind], options=ModelOptions(max_streams=4, max_seq_len=512))
        eos_row = _tilt_eos(model, case)
    else:
        model, eos_row = loaded(case.kind, case.layout), None
    official = _run_official(oracle_checkpoints[case.kind], case, eos_row)
    ours = _run_ours(model, case)
    if case.eos_probe:
        assert any(len(ours.frames[sid]) < MAX_NEW_TOKENS - 1 for sid in ours.stream_ids)
    num_heads = model.config.talker.num_code_groups - 1
    prefill = official.prefill[0]  # (B, P_max, H)
    for row, sid in enumerate(ours.stream_ids):
        # Codes: identical frames, and stopping at the same frame.
        our_codes = torch.stack(ours.frames[sid])
        assert our_codes.shape == official.codes[row].shape, f"row {row}: frame count differs"
        assert torch.equal(our_codes, official.codes[row]), f"row {row}: codes differ"
        # Prefill embeddings (the dual-track layout), row stripped of its left padding.
        if not case.has_speaker_vector:
            spec = model._prompt_spec(case.requests[row])
            ours_prefill = embed_layout(build_layout(spec, model.config, model.text_tokenizer), model.talker)
            official_row = prefill[row, prefill.shape[1] - ours_prefill.shape[0] :]
            torch.testing.assert_close(ours_prefill, official_row, atol=1e-5, rtol=0)
            if prefill.shape[1] > ours_prefill.shape[0]:
                assert prefill[row, : prefill.shape[1] - ours_prefill.shape[0]].abs().max() == 0
        # Talker logits of every step this stream took (prefill + one per frame).
        steps = ours.talker_logits[sid]
        assert len(steps) == our_codes.shape[0] + 1
        for k, logits in enumerate(steps):
            diff = (logits - official.talker_logits[k][row]).abs().max().item()
            assert diff <= LOGIT_TOL, f"row {row} talker step {k}: max abs diff {diff:.3g}"
        # Code-predictor logits, every head of every emitted frame.
        for head in range(num_heads):
            per_frame = ours.predictor_logits[(sid, head)]
            assert len(per_frame) == our_codes.shape[0]
            for f, logits in enumerate(per_frame):
                diff = (logits - official.predictor_logits[head][f][row]).abs().max().item()
                assert diff <= LOGIT_TOL, f"row {row} frame {f} head {head}: max abs diff {diff:.3g}"
        # Waveform. ICL: upstream decodes reference + generated codes and cuts
        # int(ref_len / total_len * num_samples) samples, which float rounding may make one short.
        wav, ref = ours.audio[sid], official.wavs[row]
        if case_name.startswith("base_icl"):
            ref_len = official.ref_codes[row].shape[0]
            total = ref_len + our_codes.shape[0]
            cut = int(ref_len / total * total * 1920)
            assert ref.shape[0] == total * 1920 - cut
            ref = ref[ref.shape[0] - wav.shape[0] :]
        assert wav.shape == ref.shape, f"row {row}: {wav.shape} vs {ref.shape}"
        diff = float(np.abs(wav - ref).max())
        assert diff <= WAVE_TOL, f"row {row}: waveform max abs diff {diff:.3g}"
    assert model.open_stream_ids == ()
