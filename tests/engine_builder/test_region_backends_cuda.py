"""Megakernel region backends on the GPU (CUDA executor): whole greedy utterances of the tiny Llasa and
Qwen3-TTS give the conventional path's tokens and frames in fp32, and in bf16 every teacher-forced step
has logits within bf16 tolerance whose argmax differs from the conventional one only at near-ties
(reference top-2 gap below the tolerance); the same for the NH-TTS decoder step (cross-attention over each
row's encoder keys/values, rows at different positions and text lengths). Needs an sm_90 GPU and
libtilevox_kernels.so."""

from __future__ import annotations

import pytest
import torch

from tilevox.engine_builder.regions import BackendOptions, TilingConfig, install_megakernel_regions
from tilevox.engine_builder.regions.backends import (
    MegakernelCodePredictorLoop,
    MegakernelDecoderStep,
    MegakernelNhDecoderStep,
    MegakernelTalkerStep,
)
from tilevox.models.llasa.loader import load_preset as load_llasa
from tilevox.models.nh_tts.loader import network_config
from tilevox.models.nh_tts.weights import random_network
from tilevox.models.qwen3_tts.layers import CacheView
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.region_backends import CODE_PREDICTOR_LOOP, DECODER_STEP, TALKER_STEP, PredictorRows
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest, synthesize

pytestmark = [pytest.mark.gpu, pytest.mark.requires_megakernel]

TOL = {torch.float32: 1e-3, torch.bfloat16: 6e-2}


def _llasa():
    """The tiny preset (fp32) with its Llama re-drawn to O(1) activations (matrices N(0, 1/fan_in),
    embeddings N(0, 1)), so greedy choices have clear margins; the codec is the preset's."""
    model = load_llasa("llama-tiny", device="cuda", dtype=torch.float32, max_streams=4, max_seq_len=256)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.llama.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            value = (
                1.0 + 0.1 * noise if param.dim() == 1 else noise if "embed" in name else noise / param.shape[1] ** 0.5
            )
            param.copy_(value)
    return model


def _qwen3(dtype: torch.dtype):
    return load_qwen3(
        "qwen3-tts-tiny", device="cuda", dtype=dtype, options=ModelOptions(max_streams=3, max_seq_len=256)
    )


def _assert_near_tie(choice: int, ref_row: torch.Tensor, tol: float) -> None:
    """`choice` may differ from the reference argmax only where the reference logits nearly tie."""
    gap = float(ref_row.float().max() - ref_row.float()[choice])
    assert gap <= tol, f"chose {choice}, reference argmax {int(ref_row.float().argmax())}, gap {gap} > {tol}"


def _assert_argmax_or_near_tie(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    for row, choice in enumerate(got.float().argmax(-1).tolist()):
        _assert_near_tie(choice, ref[row], tol)


def _request(text: str) -> SynthesisRequest:
    return SynthesisRequest(text=text, sampling=SamplingParams.greedy(), max_duration_s=0.6, seed=1)


def test_llasa_fp32_greedy_tokens_equal_conventional():
    model = _llasa()
    tokens: dict[str, list[int]] = {"ref": [], "mk": []}
    model.token_observer = lambda _sid, tok: tokens["ref"].append(tok)
    synthesize(model, _request("Hello from the GPU"))
    assert install_megakernel_regions(model, [DECODER_STEP], BackendOptions()) == {DECODER_STEP: None}
    model.token_observer = lambda _sid, tok: tokens["mk"].append(tok)
    synthesize(model, _request("Hello from the GPU"))
    assert len(tokens["ref"]) >= 10 and tokens["mk"] == tokens["ref"]
    assert model.decoder_step_backend.num_megakernel_calls == len(tokens["ref"]) - 1


def test_qwen3_fp32_greedy_frames_equal_conventional():
    model = _qwen3(torch.float32)
    frames: dict[str, list[torch.Tensor]] = {"ref": [], "mk": []}
    model.frame_observer = lambda _sid, codes: frames["ref"].append(codes)
    synthesize(model, _request("Good morning"))
    assert install_megakernel_regions(model, [TALKER_STEP, CODE_PREDICTOR_LOOP], BackendOptions()) == {
        TALKER_STEP: None,
        CODE_PREDICTOR_LOOP: None,
    }
    model.frame_observer = lambda _sid, codes: frames["mk"].append(codes)
    synthesize(model, _request("Good morning"))
    assert len(frames["ref"]) >= 5 and torch.equal(torch.stack(frames["mk"]), torch.stack(frames["ref"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llasa_decode_teacher_forced(dtype):
    llama = _llasa().llama.to(dtype)
    caches = [llama.new_cache(max_streams=4, max_seq_len=256) for _ in range(2)]
    gen = torch.Generator().manual_seed(2)
    slots = [1, 3, 0]
    for cache in caches:
        for _ in range(4):
            cache.allocate()
    for slot, length in zip(slots, [3, 40, 11]):
        prompt = torch.randint(0, llama.config.vocab_size, (length,), generator=gen).cuda()
        for cache in caches:
            llama.prefill(cache, slot, prompt)
    backend = MegakernelDecoderStep(llama, BackendOptions())
    tokens = torch.randint(0, llama.config.vocab_size, (3,), generator=gen).cuda()
    for _ in range(12):
        ref = llama.decode(caches[0], slots, tokens)
        got = backend(caches[1], slots, tokens)
        torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
        _assert_argmax_or_near_tie(got, ref, 2 * TOL[dtype])
        tokens = ref.float().argmax(-1)
    assert backend.num_megakernel_calls == 12 and backend.num_conventional_calls == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_talker_and_predictor_teacher_forced(dtype):
    model = _qwen3(dtype)
    talker = model.talker
    hidden_size = talker.config.transformer.hidden_size
    gen = torch.Generator().manual_seed(5)
    caches = [talker.new_cache(num_slots=3, max_len=256) for _ in range(2)]
    init = torch.randn(caches[0].keys.shape, generator=gen).to("cuda", dtype)
    for cache in caches:
        cache.keys.copy_(init)
        cache.values.copy_(init.flip(-1))
    step = MegakernelTalkerStep(talker, BackendOptions())
    predictor = MegakernelCodePredictorLoop(talker.code_predictor, BackendOptions())
    for position in (7, 8, 9):
        inputs = torch.randn(2, 1, hidden_size, generator=gen).to("cuda", dtype)

        def view(cache, position=position):
            start = torch.tensor([position, position + 30], device="cuda")
            return CacheView(cache=cache, slots=torch.tensor([2, 0], device="cuda"), start=start, kv_len=position + 31)

        with torch.no_grad():
            ref_hidden, ref_logits = talker.forward_tokens(inputs, view(caches[0]))
            got_hidden, got_logits = step(inputs, view(caches[1]))
            torch.testing.assert_close(got_hidden.float(), ref_hidden.float(), atol=TOL[dtype], rtol=TOL[dtype])
            torch.testing.assert_close(got_logits.float(), ref_logits.float(), atol=TOL[dtype], rtol=TOL[dtype])
            _assert_argmax_or_near_tie(got_logits, ref_logits, 2 * TOL[dtype])
            code0 = talker.embed_codec(ref_logits.float().argmax(-1))
            ref_head_logits = []

            def choose(head, logits, record=ref_head_logits):
                record.append(logits)
                return logits.float().argmax(-1)

            ref_codes = talker.code_predictor.predict(ref_hidden, code0, choose)
            rows = PredictorRows(params=(SamplingParams.greedy(),) * 2, seeds=(0, 0), rng_offsets=(0, 0))
            got_codes = predictor(ref_hidden, code0, lambda *_: pytest.fail("the predictor call fell back"), rows)
        for row in range(2):  # identical up to the first head where the reference had a near-tie
            differs = torch.nonzero(got_codes[row] != ref_codes[row]).flatten().tolist()
            if differs:
                head = differs[0]
                _assert_near_tie(int(got_codes[row, head]), ref_head_logits[head][row], 2 * TOL[dtype])
    assert step.num_conventional_calls == 0 and predictor.num_conventional_calls == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nh_decoder_step_teacher_forced(dtype):
    """random:nh-tts-tiny's network on the GPU: MegakernelNhDecoderStep (CUDA executor) against
    NhTtsNetwork.step on an identical cache, three rows at positions 6 / 0 / 17 with text lengths 9 / 1 / 30,
    eight teacher-forced steps: logits (every channel) within TOL, argmax equal up to near-ties."""
    network = random_network(network_config("nh-tts-tiny"), seed=1, device="cuda", dtype=dtype)
    config = network.config
    channels, vocab = config.decoder.num_channels, config.decoder.vocab_size
    gen = torch.Generator().manual_seed(4)
    rows, positions, texts = [5, 0, 2], [6, 0, 17], [9, 1, 30]
    caches = [network.new_cache(max_rows=8, max_seq_len=64, max_text_len=32) for _ in range(2)]
    encoded = torch.randn(3, 32, config.encoder.hidden_size, generator=gen).to("cuda", dtype)
    valid = (torch.arange(32)[None, :] < torch.tensor(texts)[:, None]).cuda()
    prefixes = [torch.randint(0, vocab, (1, n, channels), generator=gen).cuda() for n in positions]
    for cache in caches:
        cache.claim(rows)
        network.decoder.write_cross(cache, rows, encoded, valid)
        for row, prefix in zip(rows, prefixes):
            if prefix.shape[1]:
                network.step(cache, [row], prefix)
    tiling = TilingConfig(matvec_rows=24, lm_head_rows=100, heads_per_qkv_tile=2, partition_tokens=7, cross_attn_rows=2)
    backend = MegakernelNhDecoderStep(network, BackendOptions(tiling=tiling))
    for _ in range(8):
        codes = torch.randint(0, vocab, (3, 1, channels), generator=gen).cuda()
        with torch.no_grad():
            ref = network.step(caches[0], rows, codes)
            got = backend(caches[1], rows, codes)
        assert got.shape == ref.shape == (3, channels, vocab)
        torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
        _assert_argmax_or_near_tie(got.flatten(0, 1), ref.flatten(0, 1), 2 * TOL[dtype])
    assert backend.num_megakernel_calls == 8 and backend.num_conventional_calls == 0
    assert caches[1].lengths == caches[0].lengths
