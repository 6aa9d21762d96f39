"""The executor's region backends on CPU (eager: the reference the CUDA graphs must equal): the same
tokens, frames and audio as the models' plain path (fp32, greedy); sampled predictor codes equal the
megakernel interpreter's draws; a stream's output does not depend on the streams beside it; calls the
backends cannot take run the plain path with a logged reason; buckets are what the docs say."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.conftest import sampled_frames
from tilevox.engine_builder.regions import region_compiler
from tilevox.executor import GraphOptions, install_graph_regions
from tilevox.executor.graphs import LOGGER_NAME, MIN_KEY_BUCKET, batch_bucket, key_bucket
from tilevox.executor.megakernel import BackendOptions, Executor, install_megakernel_regions
from tilevox.models.llasa.loader import load_preset as load_llasa
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.region_backends import (
    CHUNK_DECODE,
    CODE_PREDICTOR_LOOP,
    CODEC_DECODE,
    DECODER_PREFILL,
    DECODER_STEP,
    TALKER_PREFILL,
    TALKER_STEP,
    TOKEN_SAMPLING,
)
from tilevox.models.registry import load_model
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest, synthesize

EAGER = GraphOptions(capture=False)


def _qwen3(max_streams: int = 3):
    return load_qwen3("qwen3-tts-tiny", options=ModelOptions(max_streams=max_streams, max_seq_len=400))


def _llasa():
    return load_llasa("llama-tiny", device="cpu", dtype=torch.float32, max_streams=4, max_seq_len=400)


def _greedy(text: str, seconds: float) -> SynthesisRequest:
    return SynthesisRequest(text=text, sampling=SamplingParams.greedy(), max_duration_s=seconds, seed=3)


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 17, 33, 65, 256)] == [1, 2, 4, 8, 24, 48, 96, 256]
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        batch_bucket(257)
    assert key_bucket(1, 4096) == MIN_KEY_BUCKET
    assert [key_bucket(n, 4096) for n in (256, 257, 1025, 4096)] == [256, 512, 2048, 4096]
    assert key_bucket(300, 400) == 400 and key_bucket(5, 64) == 64
    with pytest.raises(ValueError):
        key_bucket(65, 64)


def test_qwen3_executor_equals_the_plain_path():
    """Talker step, predictor loop, codec decode and token sampling (greedy: the same argmax of the same
    penalised logits): same frames, audio within 1e-5, over more than 256 positions so that both key
    buckets of a 400-position cache (256, then 400) are used."""
    request = _greedy("Good morning, this runs long enough to cross a key bucket.", 22.0)
    frames: dict[str, list[torch.Tensor]] = {"plain": [], "executor": []}
    model = _qwen3()
    model.frame_observer = lambda _sid, codes: frames["plain"].append(codes)
    plain = synthesize(model, request)
    assert install_graph_regions(model, options=EAGER) == {
        TALKER_STEP: None,
        CODE_PREDICTOR_LOOP: None,
        CODEC_DECODE: None,
        TOKEN_SAMPLING: None,
        TALKER_PREFILL: "off (GraphOptions.prefill=False): its eager form runs",
    }
    model.frame_observer = lambda _sid, codes: frames["executor"].append(codes)
    got = synthesize(model, request)
    assert len(frames["plain"]) > 200
    assert model.talker_step_backend.keys_used == {(1, 256), (1, 400)}
    assert torch.equal(torch.stack(frames["executor"]), torch.stack(frames["plain"]))
    np.testing.assert_allclose(got.samples, plain.samples, atol=1e-5, rtol=0)
    assert model.talker_step_backend.num_graph_calls == plain.num_frames
    assert model.code_predictor_loop_backend.num_graph_calls == plain.num_frames
    assert model.codec_decode_backend.num_graph_calls == plain.num_frames  # one frame per call by default
    assert model.codec_decode_backend.keys_used == {(1, 1)}


def _staggered_audio(model, requests, join_at: tuple[int, ...]) -> list[np.ndarray]:
    """Each request's audio when the first opens alone and request k joins the running ones (stepped
    together) at step join_at[k - 1]; stepped until all end."""
    assert len(join_at) == len(requests) - 1
    ids = [model.open_stream(requests[0])]
    audio: dict[int, list[np.ndarray]] = {ids[0]: []}
    steps = 0
    while live := [i for i in ids if i in model.open_stream_ids]:
        steps += 1
        if steps in join_at:
            ids.append(model.open_stream(requests[len(ids)]))
            audio[ids[-1]] = []
            live.append(ids[-1])
        for chunk in model.step(live):
            audio[chunk.stream_id].append(chunk.samples)
    assert len(ids) == len(requests)  # every join happened while a stream still ran
    return [np.concatenate(audio[i]) for i in ids]


def test_batched_codec_decode_equals_each_stream_alone():
    """Streams of different lengths joining and leaving: each one's audio through the executor's codec
    decode (padded to a batch bucket, rows of the pool) equals its audio decoded alone on the plain path."""
    requests = [_greedy(f"Codec stream {n} " * (n + 1), 0.6 + 0.3 * n) for n in range(3)]
    alone = [synthesize(_qwen3(), r).samples for r in requests]
    model = _qwen3()
    install_graph_regions(model, [CODEC_DECODE], EAGER)
    for got, want in zip(_staggered_audio(model, requests, join_at=(3, 6)), alone, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert {bucket for bucket, _ in model.codec_decode_backend.keys_used} >= {1, 2, 4}  # 3 streams: bucket 4


def test_llasa_executor_equals_the_plain_path():
    request = _greedy("Hello there, Llasa", 1.0)
    tokens: dict[str, list[int]] = {"plain": [], "executor": []}
    model = _llasa()
    model.token_observer = lambda _sid, token: tokens["plain"].append(token)
    plain = synthesize(model, request)
    assert install_graph_regions(model, options=EAGER) == {
        DECODER_STEP: None,
        TOKEN_SAMPLING: None,
        DECODER_PREFILL: "off (GraphOptions.prefill=False): its eager form runs",
        CHUNK_DECODE: None,
    }
    model.token_observer = lambda _sid, token: tokens["executor"].append(token)
    got = synthesize(model, request)
    assert len(tokens["plain"]) > 10 and tokens["executor"] == tokens["plain"]
    np.testing.assert_allclose(got.samples, plain.samples, atol=1e-5, rtol=0)
    assert model.decoder_step_backend.num_graph_calls > 10
    assert model.token_sampling_backend.num_graph_calls == len(tokens["plain"])
    # a call per 5-frame block once 8 lookahead frames exist, and one for the tail
    assert model.chunk_decode_backend.num_graph_calls == (len(tokens["plain"]) - 8) // 5 + 1


def test_llasa_block_decodes_of_staggered_streams_equal_each_stream_alone():
    """Streams that join mid-way have windows of different lengths due in one step: the executor's chunk
    decode pads them (to a multiple of WINDOW_BUCKET frames and a batch bucket) into one masked call, and
    each stream's audio equals its audio alone on the plain path (fp32, greedy)."""
    requests = [_greedy(f"Staggered Llasa stream number {n}", 1.2 + 0.2 * n) for n in range(3)]
    alone = [synthesize(_llasa(), r).samples for r in requests]
    model = _llasa()
    install_graph_regions(model, [CHUNK_DECODE], EAGER)
    # join mid-way at steps 4 and 11: their block boundaries fall on other steps
    for got, want in zip(_staggered_audio(model, requests, join_at=(4, 11)), alone, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert {width for _, width in model.chunk_decode_backend.keys_used} == {64, 128}  # windows of 13..89 frames
    assert max(bucket for bucket, _ in model.chunk_decode_backend.keys_used) >= 2


def _sampled_frames(seeds: list[int], install, steps: int = 5) -> dict[int, list[torch.Tensor]]:
    model = _qwen3(max_streams=len(seeds))
    install(model)
    return sampled_frames(model, seeds, SamplingParams(temperature=0.9, top_k=30, top_p=0.9), steps=steps)


def test_sampled_predictor_draws_equal_the_megakernel_interpreter():
    """Same counter-based draw as the megakernel's SAMPLE_EMBED (stream seed, frame x (Q-1) + head)."""

    def executor(model):
        install_graph_regions(model, [CODE_PREDICTOR_LOOP], EAGER)

    def interpreter(model):
        install_megakernel_regions(
            model, [CODE_PREDICTOR_LOOP], BackendOptions(compiler=region_compiler(), executor=Executor.VM)
        )

    got, want = _sampled_frames([5, 9], executor), _sampled_frames([5, 9], interpreter)
    for seed in (5, 9):
        n = min(len(got[seed]), len(want[seed]))
        assert n >= 3 and torch.equal(torch.stack(got[seed][:n]), torch.stack(want[seed][:n]))


def test_a_stream_is_the_same_alone_and_beside_others():
    def executor(model):
        install_graph_regions(model, options=EAGER)

    together = _sampled_frames([5, 6, 7, 8, 9], executor)
    alone = _sampled_frames([7], executor)
    n = min(len(alone[7]), len(together[7]))
    assert n >= 3
    assert torch.equal(torch.stack(alone[7][:n]), torch.stack(together[7][:n]))
    assert not torch.equal(torch.stack(together[7][:n]), torch.stack(together[8][:n]))


def test_llasa_sampled_tokens_are_the_same_alone_and_beside_others():
    """The executor's token sampling (repetition penalty on) draws per stream, whatever shares the batch."""
    sampling = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.2)

    def tokens_of(seeds: list[int]) -> dict[int, list[int]]:
        model = _llasa()
        install_graph_regions(model, options=EAGER)
        seen: dict[int, list[int]] = {}
        model.token_observer = lambda sid, token: seen.setdefault(sid, []).append(token)
        ids = [
            model.open_stream(SynthesisRequest(text="Sampled Llasa", sampling=sampling, seed=s, max_duration_s=0.3))
            for s in seeds
        ]
        while live := [i for i in ids if i in model.open_stream_ids]:
            model.step(live)
        assert model.token_sampling_backend.num_graph_calls > 5
        return {seed: seen[i] for seed, i in zip(seeds, ids)}

    together, alone = tokens_of([4, 5, 6]), tokens_of([5])
    assert len(alone[5]) > 5 and alone[5] == together[5]
    assert together[4] != together[5]


def test_calls_it_cannot_take_run_the_plain_path_and_say_why(caplog):
    model = _qwen3()
    install_graph_regions(model, options=GraphOptions(capture=False, max_batch=1))
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    ids = [model.open_stream(_greedy("Two streams", 1.0)) for _ in range(2)]
    model.step(ids)
    model.step(ids)
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert sum("batch 2 above max_batch 1" in m for m in messages) == 4  # once per region, not per call
    assert model.talker_step_backend.num_conventional_calls == 2
    assert model.codec_decode_backend.num_conventional_calls == 2
    penalised = SynthesisRequest(
        text="Penalty", sampling=SamplingParams(temperature=0.9, repetition_penalty=1.3), max_duration_s=1.0
    )
    model2 = _qwen3()
    install_graph_regions(model2, [CODE_PREDICTOR_LOOP], EAGER)
    model2.generation = type(model2.generation)(subtalker_dosample=False)
    stream = model2.open_stream(penalised)
    model2.step([stream])
    assert model2.code_predictor_loop_backend.num_graph_calls == 1  # greedy predictor: in the executor
    with pytest.raises(ValueError, match="no region 'decoder_step'"):
        install_graph_regions(model, [DECODER_STEP], EAGER)


def test_compiled_regions_equal_the_plain_path_and_compile_once_per_batch_kind():
    """GraphOptions(compile=True) (Inductor, here its CPU code): greedy frames identical to the plain path,
    audio within 1e-4, over both key buckets of the cache (256, then 400 = the whole cache: still the same
    compiled code); then 3 and 2 sampled streams (buckets 4 and 2) reuse one dynamic-batch compilation."""
    import torch._dynamo.utils

    request = _greedy("Good morning, this runs long enough to cross a key bucket.", 22.0)
    frames: dict[str, list[torch.Tensor]] = {"plain": [], "compiled": []}
    model = _qwen3()
    model.frame_observer = lambda _sid, codes: frames["plain"].append(codes)
    plain = synthesize(model, request)
    install_graph_regions(model, options=GraphOptions(capture=False, compile=True))
    model.frame_observer = lambda _sid, codes: frames["compiled"].append(codes)
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    got = synthesize(model, request)
    assert model.talker_step_backend.keys_used == {(1, 256), (1, 400)}
    assert torch.equal(torch.stack(frames["compiled"]), torch.stack(frames["plain"]))
    np.testing.assert_allclose(got.samples, plain.samples, atol=1e-4, rtol=0)
    # batch 1: the talker step, the predictor loop and codebook-0 sampling, each compiled once
    assert graphs["unique_graphs"] - before == 3
    sampled = SamplingParams(temperature=0.9, top_k=30, top_p=0.9)
    sampled_frames(model, [5, 6, 7], sampled, steps=3)
    after_first_batch = graphs["unique_graphs"]
    # the same three for any other batch (dynamic), and one specialisation for the sampled rows' filter
    # plan (a top-k of 64 candidates and a nucleus, executor.sampling.filter_plan; greedy rows need neither)
    assert after_first_batch - before == 7
    for stream_id in model.open_stream_ids:
        model.close(stream_id)
    sampled_frames(model, [8, 9], sampled, steps=3)
    assert graphs["unique_graphs"] == after_first_batch
    assert model.talker_step_backend.keys_used >= {(4, 256), (2, 256)}


@pytest.mark.parametrize("prefill_tokens", [8192, 100])
def test_the_prefill_region_pads_to_buckets_and_equals_the_plain_prefill(prefill_tokens):
    """GraphOptions(prefill=True): three prompts of different lengths prefilled together (padded to batch
    bucket 4 and a prompt-length bucket) give the plain path's greedy frames and audio; with a prefill_tokens
    budget below 4 rows of that bucket, the rows run in parts of fewer rows, with the same results."""
    texts = ["Short", "A somewhat longer prompt for the batch", "Middle length text"]
    requests = [_greedy(text, 1.0) for text in texts]

    def run(install: bool):
        model = _qwen3()
        if install:
            options = GraphOptions(capture=False, prefill=True, prefill_tokens=prefill_tokens)
            install_graph_regions(model, [TALKER_PREFILL], options)
        frames: dict[int, list[torch.Tensor]] = {}
        model.frame_observer = lambda sid, codes: frames.setdefault(sid, []).append(codes)
        ids = model.open_streams(requests)
        audio = {i: [] for i in ids}
        while live := [i for i in ids if i in model.open_stream_ids]:
            for chunk in model.step(live):
                audio[chunk.stream_id].append(chunk.samples)
        return model, [(torch.stack(frames[i]), np.concatenate(audio[i])) for i in ids]

    plain_model, plain = run(False)
    model, got = run(True)
    keys = model.talker_prefill_backend.keys_used
    if prefill_tokens == 8192:  # one call: 3 prompts padded to 4 rows
        ((bucket, span),) = keys
        assert bucket == 4 and span >= 32 and span & (span - 1) == 0
        assert model.talker_prefill_backend.num_graph_calls == 1
    else:  # parts of at most prefill_tokens padded positions, each prompt whole
        assert {bucket for bucket, _ in keys} <= {1, 2} and all(
            bucket * span <= 100 or bucket == 1 for bucket, span in keys
        )
        assert model.talker_prefill_backend.num_graph_calls >= 2
    for (frames, audio), (want_frames, want_audio) in zip(got, plain):
        assert frames.shape[0] > 5 and torch.equal(frames, want_frames)
        np.testing.assert_allclose(audio, want_audio, atol=1e-4, rtol=0)


@pytest.mark.parametrize("prefill_tokens", [8192, 100])
def test_the_llasa_prefill_region_pads_to_buckets_and_equals_prefill_many(prefill_tokens):
    """decoder_prefill (GraphOptions(prefill=True)): three prompts in one call, padded to batch bucket 4 and
    a length bucket: the same greedy tokens as the plain batched prefill, and the slots' lengths set; with a
    small prefill_tokens budget, in parts of fewer rows, the same tokens."""
    texts = ["Short", "A somewhat longer prompt for the batch", "Middle length text"]
    requests = [_greedy(text, 0.3) for text in texts]

    def run(install: bool):
        model = _llasa()
        if install:
            options = GraphOptions(capture=False, prefill=True, prefill_tokens=prefill_tokens)
            install_graph_regions(model, [DECODER_PREFILL], options)
        tokens: dict[int, list[int]] = {}
        model.token_observer = lambda sid, token: tokens.setdefault(sid, []).append(token)
        ids = model.open_streams(requests)
        while live := [i for i in ids if i in model.open_stream_ids]:
            model.step(live)
        return model, [tokens[i] for i in ids]

    _, plain = run(False)
    model, got = run(True)
    keys = model.decoder_prefill_backend.keys_used
    if prefill_tokens == 8192:
        ((bucket, span),) = keys
        assert bucket == 4 and span >= 32 and model.decoder_prefill_backend.num_graph_calls == 1
    else:
        assert {bucket for bucket, _ in keys} <= {1, 2} and model.decoder_prefill_backend.num_graph_calls >= 2
    assert all(len(t) > 5 for t in plain) and got == plain


def test_nh_tts_regions_in_the_executor_equal_the_plain_path():
    """NH-TTS's decoder step (nh_decoder_step: key, text and batch buckets) and DAC chunk decode (dac_chunk:
    widths in multiples of 16 frames) through the executor (eagerly on a CPU): three streams of different text
    lengths give the plain path's codes at every position and its audio (without an audio prompt a stream's
    prompt is one position, BOS, so it is a graph call too)."""
    from tilevox.models.region_backends import DAC_CHUNK, NH_DECODER_STEP

    requests = [
        SynthesisRequest(text="[S1] Short.", seed=1, max_duration_s=0.4, sampling=SamplingParams.greedy()),
        SynthesisRequest(text="[S1] A much longer line of text. [S2] And a reply.", seed=2, max_duration_s=0.4),
        SynthesisRequest(text="[S2] Middle one.", seed=3, max_duration_s=0.25),
    ]

    def run(install: bool):
        model = load_model("random:nh-tts-tiny")
        if install:
            assert install_graph_regions(model, [NH_DECODER_STEP, DAC_CHUNK], GraphOptions(capture=False)) == {
                NH_DECODER_STEP: None,
                DAC_CHUNK: None,
            }
        codes: dict[int, list[torch.Tensor]] = {}
        model.code_observer = lambda sid, position, c: codes.setdefault(sid, []).append(c.clone())
        ids = model.open_streams(requests)
        audio = {i: [] for i in ids}
        while live := [i for i in ids if i in model.open_stream_ids]:
            for chunk in model.step(live):
                audio[chunk.stream_id].append(chunk.samples)
        return model, [(torch.stack(codes[i]), np.concatenate(audio[i])) for i in ids]

    _, plain = run(False)
    model, got = run(True)
    step, chunk = model.nh_decoder_step_backend, model.dac_chunk_backend
    assert step.num_graph_calls > 10 and step.num_conventional_calls == 0
    # 3 streams x 2 rows padded to 8 (copies of row 0), then 4 rows once the shortest has ended
    assert {key[0] for key in step.keys_used} == {8, 4} and chunk.num_graph_calls > 0
    assert all(width % 16 == 0 for _, width in chunk.keys_used)
    for (codes, audio), (want_codes, want_audio) in zip(got, plain):
        assert codes.shape[0] > 20 and torch.equal(codes, want_codes)
        assert audio.size > 0 and audio.size == want_audio.size
        np.testing.assert_allclose(audio, want_audio, atol=1e-5, rtol=0)


def test_nh_tts_encoder_region_pads_rows_and_positions():
    """nh_encoder: both guidance rows of three texts of 5 to 70 bytes (6 rows padded to bucket 8 with copies of
    row 0, positions to the text bucket 128, not valid) give the eager encoder's valid positions (the keys
    attended differ only by masked padding); a call above max_batch runs the encoder itself, said once."""
    from tilevox.executor.graphs import GraphedNhEncoder
    from tilevox.models.region_backends import NH_ENCODER

    model = load_model("random:nh-tts-tiny")
    assert install_graph_regions(model, [NH_ENCODER], EAGER) == {NH_ENCODER: None}
    backend = model.nh_encoder_backend
    assert isinstance(backend, GraphedNhEncoder)
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 70, 33]
    ids = torch.zeros(6, 70, dtype=torch.long)
    valid = torch.zeros(6, 70, dtype=torch.bool)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, 256, (n,), generator=generator)
        valid[b, :n] = valid[b + 3, :n] = True  # the unconditional row: zeros, the same mask
    want = model.network.encode_text(ids, valid)
    got = backend(ids, valid)
    assert got.shape == want.shape == (6, 70, model.config.encoder.hidden_size)
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)
    one = backend(ids[1:2, :3], valid[1:2, :3])
    torch.testing.assert_close(one, model.network.encode_text(ids[1:2, :3], valid[1:2, :3]), atol=1e-5, rtol=0)
    assert backend.keys_used == {(8, 128), (1, 64)} and backend.num_graph_calls == 2

    small = GraphedNhEncoder(model.network.encoder, GraphOptions(capture=False, max_batch=4))
    assert torch.equal(small(ids, valid), want) and small.num_conventional_calls == 1


def test_nh_tts_sampling_region_greedy_equals_the_plain_path_and_draws_per_stream():
    """nh_sampling (with all of NH-TTS's regions, eagerly): greedy streams (guidance top-k, repetition penalty,
    min_new_tokens) give the plain path's codes at every position, three streams ending at different steps;
    a sampled stream (the preset's default sampling) draws the same alone and beside the greedy ones."""
    from tilevox.models.region_backends import NH_SAMPLING

    greedy = [
        SynthesisRequest(text="[S1] Short.", seed=1, max_duration_s=0.3, sampling=SamplingParams.greedy()),
        SynthesisRequest(
            text="[S1] A much longer line of text. [S2] And a reply.",
            max_duration_s=0.4,
            sampling=SamplingParams(temperature=0.0, top_k=5, repetition_penalty=1.3, min_new_tokens=4),
        ),
        SynthesisRequest(text="[S2] Mid.", max_duration_s=0.2, sampling=SamplingParams(temperature=0.0, top_k=3)),
    ]
    sampled = SynthesisRequest(text="[S1] Drawn on the device.", seed=11, max_duration_s=0.35)

    def run(install: bool, requests):
        model = load_model("random:nh-tts-tiny")
        if install:
            assert set(install_graph_regions(model, options=EAGER).values()) == {None}
        codes: dict[int, list[torch.Tensor]] = {}
        model.code_observer = lambda sid, position, c: codes.setdefault(sid, []).append(c.clone())
        ids = model.open_streams(requests)
        while live := [i for i in ids if i in model.open_stream_ids]:
            model.step(live)
        return model, [torch.stack(codes[i]) for i in ids]

    _, plain = run(False, greedy)
    model, got = run(True, [*greedy, sampled])
    assert len({c.shape[0] for c in plain}) == 3
    for codes, want in zip(got, plain):
        assert codes.shape[0] > 20 and torch.equal(codes, want)
    backend = getattr(model, f"{NH_SAMPLING}_backend")
    assert backend.num_conventional_calls == 0 and {bucket for bucket, _ in backend.keys_used} >= {4, 2, 1}
    _, (alone,) = run(True, [sampled])
    assert sampled.sampling is None and alone.shape[0] > 20 and torch.equal(got[3], alone)
