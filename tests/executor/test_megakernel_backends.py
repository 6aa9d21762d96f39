"""Megakernel region backends on CPU through the VM executor: the Llasa decoder step and the Qwen3-TTS
talker step and code-predictor loop give the conventional path's tokens, codes and audio (fp32, greedy)
and logits within VM tolerance; construction refuses what can never run, a call it cannot take runs
conventionally with its reason logged once; region names parse or fail with the valid names. Batch buckets:
a batch of 3 padded to bucket 4 (copies of row 0) gives each region's exact-batch results for its 3 rows,
leaves the other cache slots as they were and advances lengths once per real row; one compile per bucket.
The deferred error check (CUDA, sync_check off) raises a launch's error at the next call and in check(),
shown on CPU with only the CUDA pieces (pinned copy, event) faked."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from tests.conftest import decoded_nh_caches, prefilled_llama_caches, sampled_frames
from tilevox.engine_builder.regions import region_compiler
from tilevox.executor.megakernel import (
    LOGGER_NAME,
    BackendOptions,
    Executor,
    MegakernelCodePredictorLoop,
    MegakernelDecoderStep,
    MegakernelFaultError,
    MegakernelNhDecoderStep,
    MegakernelTalkerStep,
    MegakernelUnavailable,
    MegakernelWatchdogError,
    _ErrorChecks,
    install_megakernel_regions,
    parse_regions,
)
from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.weights import random_llama
from tilevox.models.llasa.loader import load_preset as load_llasa
from tilevox.models.nh_tts.loader import load_preset as load_nh_tts
from tilevox.models.qwen3_tts.layers import CacheView
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.region_backends import (
    CODE_PREDICTOR_LOOP,
    DECODER_STEP,
    TALKER_STEP,
    PredictorRows,
    set_region_backend,
)
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest, synthesize
from tilevox.trt_plugins.megakernel.instructions import ERROR_WORDS, ErrorCode

COMPILER = region_compiler()  # build-time code, handed to the run-time backends
VM = BackendOptions(compiler=COMPILER, executor=Executor.VM)
EXACT = BackendOptions(compiler=COMPILER, executor=Executor.VM, buckets=False)
ATOL = 2e-5


def _llasa(**kw):
    return load_llasa("llama-tiny", device="cpu", dtype=torch.float32, max_streams=4, max_seq_len=256, **kw)


def _qwen3():
    return load_qwen3("qwen3-tts-tiny", options=ModelOptions(max_streams=3, max_seq_len=64))


def _greedy_request(text: str, seconds: float) -> SynthesisRequest:
    return SynthesisRequest(text=text, sampling=SamplingParams.greedy(), max_duration_s=seconds, seed=3)


def _megakernel_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME and r.levelno >= logging.WARNING]


def test_llasa_decoder_step_vm_equals_conventional():
    """Whole utterance: same tokens, bit-identical audio; every decode went through the region."""
    request = _greedy_request("Hello there, how are you", 0.4)
    tokens: dict[str, list[int]] = {"ref": [], "vm": []}
    model = _llasa()
    model.token_observer = lambda _sid, tok: tokens["ref"].append(tok)
    ref = synthesize(model, request)
    assert install_megakernel_regions(model, [DECODER_STEP], VM) == {DECODER_STEP: None}
    model.token_observer = lambda _sid, tok: tokens["vm"].append(tok)
    got = synthesize(model, request)
    assert len(tokens["ref"]) >= 10 and tokens["vm"] == tokens["ref"]
    np.testing.assert_array_equal(got.samples, ref.samples)
    backend = model.decoder_step_backend
    assert backend.num_megakernel_calls == ref.num_frames - 1 and backend.num_conventional_calls == 0


def test_decoder_step_logits_for_streams_at_different_positions():
    model = _llasa()
    llama = model.llama
    gen = torch.Generator().manual_seed(4)
    slots = [3, 0, 2]
    ref_cache, vm_cache = prefilled_llama_caches(llama, 2, dict(zip(slots, [2, 23, 9], strict=True)), gen)
    backend = MegakernelDecoderStep(llama, VM)
    tokens = torch.randint(0, llama.config.vocab_size, (3,), generator=gen)
    for _ in range(3):
        ref = llama.decode(ref_cache, slots, tokens)
        got = backend(vm_cache, slots, tokens)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-5)
        assert vm_cache.lengths == ref_cache.lengths
        tokens = ref.argmax(-1)
    torch.testing.assert_close(vm_cache.k, ref_cache.k, atol=ATOL, rtol=1e-5)
    # Calls decode itself would refuse are not fallbacks: they raise decode's own error.
    with pytest.raises(ValueError, match="distinct"):
        backend(vm_cache, [0, 0], tokens[:2])


def test_qwen3_regions_vm_equal_conventional():
    """Talker step + code-predictor loop through the VM: same frames, bit-identical audio."""
    request = _greedy_request("Good morning", 0.5)
    frames: dict[str, list[torch.Tensor]] = {"ref": [], "vm": []}
    model = _qwen3()
    model.frame_observer = lambda _sid, codes: frames["ref"].append(codes)
    ref = synthesize(model, request)
    assert install_megakernel_regions(model, [TALKER_STEP, CODE_PREDICTOR_LOOP], VM) == {
        TALKER_STEP: None,
        CODE_PREDICTOR_LOOP: None,
    }
    model.frame_observer = lambda _sid, codes: frames["vm"].append(codes)
    got = synthesize(model, request)
    assert len(frames["ref"]) >= 5
    assert torch.equal(torch.stack(frames["vm"]), torch.stack(frames["ref"]))
    np.testing.assert_array_equal(got.samples, ref.samples)
    assert model.talker_step_backend.num_megakernel_calls == ref.num_frames
    assert model.code_predictor_loop_backend.num_megakernel_calls == ref.num_frames


def test_talker_step_outputs_match_forward_tokens():
    model = _qwen3()
    talker = model.talker
    hidden_size = talker.config.transformer.hidden_size
    ref_cache = talker.new_cache(num_slots=3, max_len=64)
    vm_cache = talker.new_cache(num_slots=3, max_len=64)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        ref_cache.keys.copy_(torch.randn(ref_cache.keys.shape, generator=gen))
        ref_cache.values.copy_(torch.randn(ref_cache.values.shape, generator=gen))
    vm_cache.keys.copy_(ref_cache.keys)
    vm_cache.values.copy_(ref_cache.values)
    inputs = torch.randn(2, 1, hidden_size, generator=gen)
    backend = MegakernelTalkerStep(talker, VM)

    def view(cache):
        return CacheView(cache=cache, slots=torch.tensor([2, 0]), start=torch.tensor([17, 5]), kv_len=18)

    with torch.no_grad():
        ref_hidden, ref_logits = talker.forward_tokens(inputs, view(ref_cache))
        got_hidden, got_logits = backend(inputs, view(vm_cache))
    torch.testing.assert_close(got_hidden, ref_hidden, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(got_logits, ref_logits, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(vm_cache.keys, ref_cache.keys, atol=ATOL, rtol=1e-5)


def test_sampled_predictor_codes_do_not_depend_on_the_batch():
    """With on-device sampling, a stream's frames are the same stepped alone or with another stream
    (its draws use only its seed and frame index), and a different seed gives other codes."""
    params = SamplingParams(temperature=0.9, top_k=30)

    def frames_of(seeds: list[int]) -> dict[int, list[torch.Tensor]]:
        model = _qwen3()
        install_megakernel_regions(model, [CODE_PREDICTOR_LOOP], VM)
        return sampled_frames(model, seeds, params, steps=4)

    together = frames_of([5, 6])
    alone = frames_of([5])
    n = min(len(alone[5]), len(together[5]))
    assert n >= 2
    assert torch.equal(torch.stack(alone[5][:n]), torch.stack(together[5][:n]))
    assert not torch.equal(torch.stack(together[5][:n]), torch.stack(together[6][:n]))


def test_cuda_executor_on_cpu_falls_back_with_a_logged_reason(caplog):
    request = _greedy_request("Fallback please", 0.3)
    model = _qwen3()
    ref = synthesize(model, request)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        result = install_megakernel_regions(
            model, [TALKER_STEP, CODE_PREDICTOR_LOOP], BackendOptions(compiler=COMPILER)
        )
    assert result == {TALKER_STEP: "no CUDA device is visible", CODE_PREDICTOR_LOOP: "no CUDA device is visible"}
    assert _megakernel_records(caplog) == [
        "megakernel region talker_step: conventional path: no CUDA device is visible",
        "megakernel region code_predictor_loop: conventional path: no CUDA device is visible",
    ]
    assert model.talker_step_backend is None and model.code_predictor_loop_backend is None
    got = synthesize(model, request)
    np.testing.assert_array_equal(got.samples, ref.samples)


def test_batch_above_the_limit_runs_conventionally_and_logs_once(caplog):
    """max_batch 1: two streams stepped together decode conventionally (one warning for all steps),
    a stream stepped alone goes through the region; the tokens equal an all-conventional run."""
    requests = [_greedy_request("First stream", 0.3), _greedy_request("Second one here", 0.3)]

    def run(model) -> list[list[int]]:
        tokens: dict[int, list[int]] = {}
        model.token_observer = lambda sid, tok: tokens.setdefault(sid, []).append(tok)
        ids = [model.open_stream(r) for r in requests]
        for _ in range(4):
            model.step(ids)
        for _ in range(3):
            model.step(ids[:1])
        return [tokens[i] for i in ids]

    ref = run(_llasa())
    model = _llasa()
    install_megakernel_regions(
        model, [DECODER_STEP], BackendOptions(compiler=COMPILER, executor=Executor.VM, max_batch=1)
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        got = run(model)
    assert got == ref
    assert _megakernel_records(caplog) == [
        "megakernel region decoder_step: conventional path: batch 2 exceeds max_batch 1"
    ]
    backend = model.decoder_step_backend
    assert backend.num_conventional_calls == 4 and backend.num_megakernel_calls == 3


def test_predictor_sampling_it_cannot_do_runs_conventionally(caplog):
    model = _qwen3()
    predictor = model.talker.code_predictor
    backend = MegakernelCodePredictorLoop(predictor, VM)
    hidden_size = model.talker.config.transformer.hidden_size
    gen = torch.Generator().manual_seed(2)
    hidden, code0 = torch.randn(2, hidden_size, generator=gen), torch.randn(2, hidden_size, generator=gen)
    rows = PredictorRows(
        params=(SamplingParams.greedy(repetition_penalty=1.3), SamplingParams.greedy()),
        seeds=(0, 1),
        rng_offsets=(0, 0),
    )
    calls = []

    def choose(head, logits):
        calls.append(head)
        return logits.argmax(-1)

    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME), torch.no_grad():
        got = backend(hidden, code0, choose, rows)
        backend(hidden, code0, choose, rows)
        ref = predictor.predict(hidden, code0, lambda head, logits: logits.argmax(-1))
    assert torch.equal(got, ref) and calls == list(range(predictor.num_steps)) * 2
    (message,) = _megakernel_records(caplog)
    assert message.startswith("megakernel region code_predictor_loop: conventional path: stream 0:")
    assert "repetition penalty" in message


def test_construction_refuses_what_the_kernel_cannot_run():
    config = dataclasses.replace(
        LlamaConfig.preset("tiny"), hidden_size=528, num_attention_heads=2, num_key_value_heads=1
    )
    wide_heads = random_llama(config, seed=0, device="cpu", dtype=torch.float32)
    with pytest.raises(MegakernelUnavailable, match="head_dim 264 is odd or above the kernel's 256"):
        MegakernelDecoderStep(wide_heads, VM)
    float64 = random_llama(LlamaConfig.preset("tiny"), seed=0, device="cpu", dtype=torch.float32).double()
    with pytest.raises(MegakernelUnavailable, match="dtype torch.float64"):
        MegakernelDecoderStep(float64, VM)
    with pytest.raises(MegakernelUnavailable, match="no CUDA device"):
        MegakernelDecoderStep(float64, BackendOptions(compiler=COMPILER))
    # What the fused SwiGLU swap leaves: an MLP module without the gate/up/down projections.
    swapped = random_llama(LlamaConfig.preset("tiny"), seed=0, device="cpu", dtype=torch.float32)
    swapped.model.layers[1].mlp = torch.nn.Identity()
    with pytest.raises(MegakernelUnavailable, match="fused SwiGLU swap removes them"):
        MegakernelDecoderStep(swapped, VM)
    # Run-time code compiles nothing itself: without the build-time compiler handed in, no backend.
    plain = random_llama(LlamaConfig.preset("tiny"), seed=0, device="cpu", dtype=torch.float32)
    with pytest.raises(MegakernelUnavailable, match="no region compiler given"):
        MegakernelDecoderStep(plain, BackendOptions(executor=Executor.VM))


def test_region_names_parse_and_bad_names_fail():
    llasa, qwen3 = _llasa(), _qwen3()
    assert parse_regions(llasa, "all") == (DECODER_STEP,)
    assert parse_regions(qwen3, "all") == (TALKER_STEP, CODE_PREDICTOR_LOOP, "codec_decode")
    assert parse_regions(qwen3, " none ") == () and parse_regions(qwen3, "") == ()
    assert parse_regions(qwen3, "code_predictor_loop, talker_step,code_predictor_loop") == (
        CODE_PREDICTOR_LOOP,
        TALKER_STEP,
    )
    with pytest.raises(
        ValueError, match=r"unknown megakernel region\(s\) 'talker_step'; valid: decoder_step, all, none"
    ):
        parse_regions(llasa, "talker_step")
    with pytest.raises(ValueError, match="LlasaModel has no region 'talker_step'"):
        set_region_backend(llasa, TALKER_STEP, None)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        BackendOptions(compiler=COMPILER, max_batch=0)


def _compiled_batches(backend) -> set[int]:
    """The row counts the backend's region was compiled for (one entry per bucket)."""
    return set(backend._runner._compiled)


def _prefilled_llama_caches(llama, lengths: dict[int, int], seed: int):
    """Two identical Llama caches of 4 slots, slot s prefilled with a random prompt of lengths[s] tokens."""
    caches = [llama.new_cache(max_streams=4, max_seq_len=256) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    for cache in caches:
        for _ in range(4):
            cache.allocate()
    for slot, length in lengths.items():
        prompt = torch.randint(0, llama.config.vocab_size, (length,), generator=gen)
        for cache in caches:
            llama.prefill(cache, slot, prompt)
    return caches, gen


def test_decoder_step_batch_3_in_bucket_4_equals_exact_batch_3():
    """Slots 3, 0, 2 run as 4 rows (row 0 repeated): the exact-batch region's logits and keys/values, slot 1
    (prefilled, not in the call) untouched, each real slot's length advanced once per step."""
    llama = _llasa().llama
    slots = [3, 0, 2]
    (padded_cache, exact_cache), gen = _prefilled_llama_caches(llama, {3: 2, 0: 23, 2: 9, 1: 14}, seed=4)
    untouched = (padded_cache.k[:, 1].clone(), padded_cache.v[:, 1].clone())
    padded, exact = MegakernelDecoderStep(llama, VM), MegakernelDecoderStep(llama, EXACT)
    tokens = torch.randint(0, llama.config.vocab_size, (3,), generator=gen)
    for step in range(3):
        got = padded(padded_cache, slots, tokens)
        want = exact(exact_cache, slots, tokens)
        assert got.shape == want.shape == (3, llama.config.vocab_size)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert padded_cache.lengths == exact_cache.lengths == [23 + step + 1, 14, 9 + step + 1, 2 + step + 1]
        tokens = want.argmax(-1)
    torch.testing.assert_close(padded_cache.k, exact_cache.k, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(padded_cache.v, exact_cache.v, atol=ATOL, rtol=1e-5)
    assert torch.equal(padded_cache.k[:, 1], untouched[0]) and torch.equal(padded_cache.v[:, 1], untouched[1])
    assert _compiled_batches(padded) == {4} and _compiled_batches(exact) == {3}
    assert padded.num_megakernel_calls == exact.num_megakernel_calls == 3
    assert padded.num_conventional_calls == exact.num_conventional_calls == 0


def test_talker_step_batch_3_in_bucket_4_equals_exact_batch_3():
    """Slots 2, 0, 4 of a 5-slot cache at positions 17, 5, 9: hidden states and logits of the exact batch
    (and of forward_tokens); only the three rows' new positions are written, slots 1 and 3 untouched."""
    talker = _qwen3().talker
    hidden_size = talker.config.transformer.hidden_size
    gen = torch.Generator().manual_seed(8)
    caches = [talker.new_cache(num_slots=5, max_len=64) for _ in range(3)]  # padded, exact, reference
    keys, values = torch.randn(caches[0].keys.shape, generator=gen), torch.randn(caches[0].values.shape, generator=gen)
    for cache in caches:
        cache.keys.copy_(keys)
        cache.values.copy_(values)
    padded, exact = MegakernelTalkerStep(talker, VM), MegakernelTalkerStep(talker, EXACT)
    slots, starts = torch.tensor([2, 0, 4]), torch.tensor([17, 5, 9])
    inputs = torch.randn(3, 1, hidden_size, generator=gen)

    def view(cache):
        return CacheView(cache=cache, slots=slots, start=starts, kv_len=18)

    with torch.no_grad():
        got_hidden, got_logits = padded(inputs, view(caches[0]))
        want_hidden, want_logits = exact(inputs, view(caches[1]))
        ref_hidden, ref_logits = talker.forward_tokens(inputs, view(caches[2]))
    assert got_hidden.shape == want_hidden.shape == ref_hidden.shape and got_logits.shape == ref_logits.shape
    for got, want in ((got_hidden, want_hidden), (got_logits, want_logits), (got_hidden, ref_hidden)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    assert torch.equal(got_logits.argmax(-1), want_logits.argmax(-1))
    torch.testing.assert_close(caches[0].keys, caches[2].keys, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(caches[0].values, caches[2].values, atol=ATOL, rtol=1e-5)
    written = torch.zeros(caches[0].keys.shape[1], caches[0].keys.shape[3], dtype=torch.bool)
    written[slots, starts] = True
    for got_cache, before in ((caches[0].keys, keys), (caches[0].values, values)):
        assert torch.equal(got_cache[:, ~written.any(1)], before[:, ~written.any(1)])  # slots 1 and 3
        changed = (got_cache != before).any(dim=(0, 2, 4))  # (slots, positions)
        assert torch.equal(changed, written)
    assert _compiled_batches(padded) == {4} and _compiled_batches(exact) == {3}


def test_code_predictor_loop_batch_3_in_bucket_4_equals_exact_batch_3():
    """Greedy and sampled rows: the same codes as the exact batch (draws depend on seed and offset only)."""
    talker = _qwen3().talker
    predictor, width = talker.code_predictor, talker.config.transformer.hidden_size
    gen = torch.Generator().manual_seed(6)
    padded, exact = MegakernelCodePredictorLoop(predictor, VM), MegakernelCodePredictorLoop(predictor, EXACT)
    rows = PredictorRows(
        params=(SamplingParams.greedy(), SamplingParams(temperature=0.9, top_k=30), SamplingParams.greedy()),
        seeds=(5, 6, 7),
        rng_offsets=(0, 15, 30),
    )
    for _ in range(2):
        hidden, code0 = torch.randn(3, width, generator=gen), torch.randn(3, width, generator=gen)
        fail = lambda *_: pytest.fail("the predictor call fell back")  # noqa: E731
        got = padded(hidden, code0, fail, rows)
        want = exact(hidden, code0, fail, rows)
        assert got.shape == (3, predictor.num_steps) and torch.equal(got, want)
    greedy = predictor.predict(hidden, code0, lambda head, logits: logits.argmax(-1))
    assert torch.equal(got[[0, 2]], greedy[[0, 2]])
    assert _compiled_batches(padded) == {4} and _compiled_batches(exact) == {3}
    assert set(padded._caches) == {4}


def test_nh_decoder_step_batch_3_in_bucket_4_equals_exact_batch_3():
    """Rows 4, 1, 2 at positions 3, 9, 1 with text lengths 5, 24, 11: the exact batch's logits (and
    NhTtsNetwork.step's), row 6 (decoded, not in the call) untouched, lengths advanced once per real row."""
    network = load_nh_tts("nh-tts-tiny", device="cpu", dtype=torch.float32, max_streams=3).network
    config = network.config
    channels, vocab = config.decoder.num_channels, config.decoder.vocab_size
    rows, positions, texts = [4, 1, 2, 6], [3, 9, 1, 7], [5, 24, 11, 8]
    gen = torch.Generator().manual_seed(3)
    caches = decoded_nh_caches(network, 3, rows, positions, texts, gen)
    untouched = (caches[0].self_k[:, 6].clone(), caches[0].self_v[:, 6].clone())
    padded, exact = MegakernelNhDecoderStep(network, VM), MegakernelNhDecoderStep(network, EXACT)
    for step in range(3):
        codes = torch.randint(0, vocab, (3, 1, channels), generator=gen)
        with torch.no_grad():
            got = padded(caches[0], rows[:3], codes)
            want = exact(caches[1], rows[:3], codes)
            ref = network.step(caches[2], rows[:3], codes)
        assert got.shape == want.shape == (3, channels, vocab)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert [caches[0].lengths[r] for r in rows] == [3 + step + 1, 9 + step + 1, 1 + step + 1, 7]
        assert caches[0].lengths == caches[1].lengths == caches[2].lengths
    for name in ("self_k", "self_v"):
        torch.testing.assert_close(getattr(caches[0], name), getattr(caches[1], name), atol=ATOL, rtol=1e-5)
    assert torch.equal(caches[0].self_k[:, 6], untouched[0]) and torch.equal(caches[0].self_v[:, 6], untouched[1])
    assert _compiled_batches(padded) == {4} and _compiled_batches(exact) == {3}


def test_one_compile_per_bucket():
    """Batches 3 and 4 share the bucket-4 region, 1 and 2 get their own; without buckets every batch
    compiles; a bucket above the cache's slots is capped at them (3 rows of a 3-slot cache run as 3)."""
    llama = _llasa().llama
    (cache, exact_cache), gen = _prefilled_llama_caches(llama, {0: 3, 1: 5, 2: 7, 3: 9}, seed=1)
    backend, exact = MegakernelDecoderStep(llama, VM), MegakernelDecoderStep(llama, EXACT)
    for slots in ([0, 1, 2], [3, 2, 1, 0], [1], [2, 3]):
        tokens = torch.randint(0, llama.config.vocab_size, (len(slots),), generator=gen)
        torch.testing.assert_close(
            backend(cache, slots, tokens), exact(exact_cache, slots, tokens), atol=ATOL, rtol=1e-5
        )
    assert _compiled_batches(backend) == {1, 2, 4} and _compiled_batches(exact) == {1, 2, 3, 4}
    assert backend.num_megakernel_calls == exact.num_megakernel_calls == 4
    assert cache.lengths == exact_cache.lengths == [5, 8, 10, 11]

    talker = _qwen3().talker
    step = MegakernelTalkerStep(talker, VM)
    talker_cache = talker.new_cache(num_slots=3, max_len=64)
    inputs = torch.randn(3, 1, talker.config.transformer.hidden_size, generator=gen)
    view = CacheView(cache=talker_cache, slots=torch.tensor([0, 1, 2]), start=torch.tensor([4, 0, 2]), kv_len=5)
    with torch.no_grad():
        step(inputs, view)
    assert _compiled_batches(step) == {3} and step.num_conventional_calls == 0


class _FakeEvent:
    """Stands in for torch.cuda.Event on CPU: complete once `done` is set (or synchronize() is called)."""

    def __init__(self) -> None:
        self.done = False
        self.recorded = 0

    def record(self) -> None:
        self.recorded += 1
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _fake_checks(name: str) -> tuple[_ErrorChecks, list[_FakeEvent]]:
    """_ErrorChecks whose pinned copy is a host tensor and whose events are _FakeEvents (listed)."""
    events: list[_FakeEvent] = []

    def new_slot():
        events.append(_FakeEvent())
        return torch.zeros(ERROR_WORDS, dtype=torch.int32), events[-1]

    return _ErrorChecks(name, new_slot), events


def _error_words(code: ErrorCode, *detail: int) -> torch.Tensor:
    words = torch.zeros(ERROR_WORDS, dtype=torch.int32)
    words[0] = int(code)
    words[1 : 1 + len(detail)] = torch.tensor(detail, dtype=torch.int32)
    return words


def test_deferred_error_words_are_read_once_landed_and_raised_once():
    checks, events = _fake_checks("decoder_step")
    error = _error_words(ErrorCode.OUT_OF_RANGE, 0, 5, 1, -1, 300, 256)
    checks.record(error, bucket=4)
    error.zero_()  # the next launch clears the device words: the pending copy must not see that
    checks.poll()  # the copy has not landed: no error yet, the entry stays pending
    assert checks.num_pending == 1
    events[0].done = True
    with pytest.raises(MegakernelFaultError, match="index out of range: queue 0 position 5 opcode 1") as info:
        checks.poll()
    assert "megakernel region decoder_step (batch bucket 4)" in " ".join(info.value.__notes__)
    assert checks.num_pending == 0
    checks.poll()  # reported once
    # A clean launch recycles the pinned words and event; an error drops the launches still in flight.
    checks.record(_error_words(ErrorCode.NONE), bucket=1)
    events[0].done = True
    checks.poll()
    assert len(events) == 1 and checks.num_pending == 0
    checks.record(_error_words(ErrorCode.WATCHDOG, 2, 7, 4, 11, 0, 1), bucket=8)
    checks.record(_error_words(ErrorCode.NONE), bucket=8)
    events[0].done = True
    with pytest.raises(MegakernelWatchdogError, match="watchdog: queue 2 position 7"):
        checks.poll()
    assert checks.num_pending == 0


def test_deferred_error_raises_at_the_next_call_and_in_check():
    """A launch's recorded fault (fake CUDA pieces, real bookkeeping) fails the backend's next call once its
    copy has landed, before that call runs anything; check() waits for it and raises."""
    model = _llasa()
    llama = model.llama
    (cache, _), gen = _prefilled_llama_caches(llama, {0: 4, 2: 6}, seed=2)
    backend = MegakernelDecoderStep(llama, VM)
    tokens = torch.randint(0, llama.config.vocab_size, (2,), generator=gen)
    backend(cache, [0, 2], tokens)
    runner = backend._runner
    runner.checks, events = _fake_checks(backend.name)
    runner.checks.record(_error_words(ErrorCode.OUT_OF_RANGE, 3, 0, 1, -1, 9999, 256), bucket=2)
    backend(cache, [0, 2], tokens)  # not landed yet: the call runs
    assert backend.num_megakernel_calls == 2 and cache.lengths[:3] == [6, 0, 8]
    events[0].done = True
    with pytest.raises(MegakernelFaultError, match="index out of range: queue 3"):
        backend(cache, [0, 2], tokens)
    assert backend.num_megakernel_calls == 2 and cache.lengths[:3] == [6, 0, 8]  # the failing call ran nothing
    backend(cache, [0, 2], tokens)
    assert backend.num_megakernel_calls == 3 and cache.lengths[:3] == [7, 0, 9]
    runner.checks.record(_error_words(ErrorCode.WATCHDOG, 1, 2, 4, 5, 0, 1), bucket=2)
    with pytest.raises(MegakernelWatchdogError, match="watchdog"):
        backend.check()
    backend.check()  # nothing pending


def test_options_default_to_buckets_graphs_and_deferred_checks():
    options = BackendOptions(compiler=COMPILER)
    assert options.buckets and options.cuda_graphs and not options.sync_check
