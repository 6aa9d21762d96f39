"""The executor's CUDA graphs on a GPU (skipped without one): replaying captured graphs gives bit for bit
what the same executor computes eagerly at the same batch composition (padding rows included), for
Qwen3-TTS (talker step, code-predictor loop with on-device sampling, codec decode from the state pool,
codebook-0 sampling, the talker prefill) and Llasa (decoder step, token sampling, batched prefill), and
a stream that reuses a slot gets exactly what it gets in a fresh model. The same holds with the regions
compiled by Inductor (GraphOptions(compile=True)): captured compiled code equals the compiled code run
eagerly, bit for bit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch._inductor.config as inductor_config

from tilevox.executor import GraphOptions, install_graph_regions
from tilevox.models.llasa.loader import load_preset as load_llasa
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)", allow_module_level=True)

SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)


def _qwen3(capture: bool, compile: bool = False):
    model = load_qwen3(
        "qwen3-tts-tiny", device="cuda", dtype=torch.bfloat16, options=ModelOptions(max_streams=4, max_seq_len=400)
    )
    install_graph_regions(model, options=GraphOptions(capture=capture, compile=compile, prefill=True))
    return model


def _llasa(capture: bool, compile: bool = False):
    model = load_llasa("llama-tiny", device="cuda", dtype=torch.bfloat16, max_streams=4, max_seq_len=600)
    install_graph_regions(model, options=GraphOptions(capture=capture, compile=compile, prefill=True))
    return model


def _run(model, requests: list[SynthesisRequest], observe: str) -> dict[int, tuple[list, np.ndarray]]:
    """Step all requests together to the end: per request index, (observed frames/tokens, audio)."""
    seen: dict[int, list] = {}
    setattr(model, observe, lambda sid, x: seen.setdefault(sid, []).append(x.clone() if torch.is_tensor(x) else x))
    ids = [model.open_stream(r) for r in requests]
    audio: dict[int, list[np.ndarray]] = {i: [] for i in ids}
    while live := [i for i in ids if i in model.open_stream_ids]:
        for chunk in model.step(live):
            audio[chunk.stream_id].append(chunk.samples)
    return {n: (seen.get(i, []), np.concatenate(audio[i])) for n, i in enumerate(ids)}


def _same(a, b) -> None:
    for n in a:
        (seen_a, audio_a), (seen_b, audio_b) = a[n], b[n]
        assert len(seen_a) == len(seen_b) > 3
        for x, y in zip(seen_a, seen_b):
            assert torch.equal(x, y) if torch.is_tensor(x) else x == y
        np.testing.assert_array_equal(audio_a, audio_b)


@pytest.mark.parametrize("num_streams", [1, 3])
def test_qwen3_graphs_equal_the_eager_executor(num_streams):
    requests = [
        SynthesisRequest(text=f"Graph replay {n}", sampling=SAMPLED, seed=10 + n, max_duration_s=3.0 + n)
        for n in range(num_streams)
    ]
    graph_model, eager_model = _qwen3(True), _qwen3(False)
    _same(_run(graph_model, requests, "frame_observer"), _run(eager_model, requests, "frame_observer"))
    assert graph_model.talker_step_backend.graphs.num_graphs >= 1
    assert graph_model.code_predictor_loop_backend.graphs.num_graphs >= 1
    assert graph_model.codec_decode_backend.graphs.num_graphs >= 1
    assert graph_model.token_sampling_backend.graphs.num_graphs >= 1
    assert graph_model.talker_step_backend.num_conventional_calls == 0


@pytest.mark.parametrize("num_streams", [1, 3])
def test_llasa_graphs_equal_the_eager_executor(num_streams):
    requests = [
        SynthesisRequest(text=f"Graph replay {n}", sampling=SAMPLED, seed=10 + n, max_duration_s=1.0 + n / 2)
        for n in range(num_streams)
    ]
    graph_model, eager_model = _llasa(True), _llasa(False)
    _same(_run(graph_model, requests, "token_observer"), _run(eager_model, requests, "token_observer"))
    assert graph_model.decoder_step_backend.graphs.num_graphs >= 1
    assert graph_model.chunk_decode_backend.graphs.num_graphs >= 1
    assert graph_model.token_sampling_backend.graphs.num_graphs >= 1
    assert graph_model.chunk_decode_backend.graphs.num_graphs >= 1


def test_a_reused_slot_sees_nothing_of_the_previous_stream():
    first = SynthesisRequest(
        text="A long first stream that fills the cache", sampling=SAMPLED, seed=1, max_duration_s=6
    )
    second = SynthesisRequest(text="Second", sampling=SAMPLED, seed=2, max_duration_s=2.0)
    model = _qwen3(True)
    _run(model, [first], "frame_observer")
    reused = _run(model, [second], "frame_observer")
    _same(reused, _run(_qwen3(True), [second], "frame_observer"))


def test_compiled_graphs_equal_the_compiled_code_run_eagerly():
    """Inductor's code for each region, captured in the executor's graphs, equals the same compiled code
    run without graphs, bit for bit (3 streams: a padded batch bucket; sampled; both models). The end of
    speech is held off for 8 tokens: with random weights a sampled stream may otherwise stop after 3 frames
    (H200, 2026-12-04, once the cache writes went through tilevox::write_kv_cache), too short to compare."""
    sampling = dataclasses.replace(SAMPLED, min_new_tokens=8)
    requests = [
        SynthesisRequest(text=f"Compiled replay {n}", sampling=sampling, seed=20 + n, max_duration_s=2.0 + n / 2)
        for n in range(3)
    ]

    def fresh_compile(run):
        # Both models' regions are bound methods of one code object, and Dynamo keeps what it learnt about a code
        # object's shapes (automatic dynamic) across instances: the second model would compile its first call
        # already dynamic, the first model's specialised, so the two would run different kernels (H100,
        # 2026-12-07: equal tokens, XCodec2 audio 1e-3 apart). Each model starts from a fresh Dynamo state.
        # Each compile also times a reduction's candidate configurations on the device and keeps the fastest;
        # two compiles may keep different ones, which sum in another order (H100, 2026-12-08, with the fresh
        # state: equal tokens, XCodec2 audio 4.5e-8 apart). Inductor's deterministic mode picks without timing,
        # so that both runs execute the same kernels and only the capture differs.
        torch._dynamo.reset()
        with inductor_config.patch(deterministic=True):
            return run()

    graph_model, eager_model = _qwen3(True, compile=True), _qwen3(False, compile=True)
    graph_run = fresh_compile(lambda: _run(graph_model, requests, "frame_observer"))
    _same(graph_run, fresh_compile(lambda: _run(eager_model, requests, "frame_observer")))
    assert graph_model.code_predictor_loop_backend.graphs.num_graphs >= 1
    graph_model, eager_model = _llasa(True, compile=True), _llasa(False, compile=True)
    graph_run = fresh_compile(lambda: _run(graph_model, requests, "token_observer"))
    _same(graph_run, fresh_compile(lambda: _run(eager_model, requests, "token_observer")))
    assert graph_model.decoder_step_backend.graphs.num_graphs >= 1
    assert graph_model.chunk_decode_backend.graphs.num_graphs >= 1


_NH_REQUESTS = [
    SynthesisRequest(text="[S1] Short.", seed=1, max_duration_s=0.4, sampling=SamplingParams.greedy()),
    SynthesisRequest(text="[S1] A much longer line of text. [S2] And a reply.", seed=2, max_duration_s=0.4),
    SynthesisRequest(text="[S2] Middle one.", seed=3, max_duration_s=0.25),
]
# Repetition penalties (the pick reads each row's history inside its graph), min_new_tokens, a top-p without a
# top-k, a greedy stream with a guidance top-k, a text longer than one 64-byte encoder bucket.
_NH_PENALISED = [
    SynthesisRequest(
        text="[S1] Penalised and sampled. " * 3,
        seed=4,
        max_duration_s=0.5,
        sampling=SamplingParams(temperature=1.1, top_k=40, top_p=0.9, repetition_penalty=1.2, min_new_tokens=5),
    ),
    SynthesisRequest(
        text="[S2] Greedy.", seed=5, max_duration_s=0.3, sampling=SamplingParams(temperature=0.0, top_k=5)
    ),
    SynthesisRequest(
        text="[S1] Nucleus only.",
        seed=6,
        max_duration_s=0.2,
        sampling=SamplingParams(temperature=0.8, top_k=0, top_p=0.8, repetition_penalty=0.9),
    ),
]


@pytest.mark.parametrize("requests", [_NH_REQUESTS, _NH_PENALISED], ids=["default", "penalised"])
def test_nh_tts_graphs_equal_the_eager_executor(requests):
    """NH-TTS (nh_encoder, nh_decoder_step, nh_sampling, dac_chunk) captured vs the same executor run eagerly,
    bf16: the same codes at every position (greedy and sampled streams: the pick and its counter-based draw
    run in the graph) and bit-identical audio, for three streams (6 cache rows padded to 8, then fewer)."""
    from tilevox.models.nh_tts.loader import load_preset as load_nh

    def run(capture: bool):
        model = load_nh("nh-tts-tiny", device="cuda", dtype=torch.bfloat16, max_streams=4)
        installed = install_graph_regions(model, options=GraphOptions(capture=capture))
        assert set(installed.values()) == {None}, installed
        codes: dict[int, list[torch.Tensor]] = {}
        model.code_observer = lambda sid, position, c: codes.setdefault(sid, []).append(c.clone())
        ids = model.open_streams(requests)
        audio = {i: [] for i in ids}
        while live := [i for i in ids if i in model.open_stream_ids]:
            for chunk in model.step(live):
                audio[chunk.stream_id].append(chunk.samples)
        return model, [(codes[i], np.concatenate(audio[i])) for i in ids]

    _, eager = run(False)
    model, graphed = run(True)
    assert model.nh_decoder_step_backend.graphs.num_graphs > 0 and model.dac_chunk_backend.graphs.num_graphs > 0
    assert model.nh_encoder_backend.graphs.num_graphs == 1 and model.nh_sampling_backend.graphs.num_graphs >= 2
    assert model.nh_sampling_backend.num_conventional_calls == 0
    for (codes, audio), (want_codes, want_audio) in zip(graphed, eager):
        assert len(codes) == len(want_codes) > 20 and all(torch.equal(a, b) for a, b in zip(codes, want_codes))
        np.testing.assert_array_equal(audio, want_audio)
