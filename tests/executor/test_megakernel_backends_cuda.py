"""Megakernel region backends on the GPU (CUDA executor): whole greedy utterances of the tiny Llasa and
Qwen3-TTS give the conventional path's tokens and frames in fp32, and in bf16 every teacher-forced step
has logits within bf16 tolerance whose argmax differs from the conventional one only at near-ties
(reference top-2 gap below the tolerance); the same for the NH-TTS decoder step (cross-attention over each
row's encoder keys/values, rows at different positions and text lengths). Batch buckets, CUDA graphs and the
deferred error check: each backend's graph replays equal eager launches with sync_check=True bit for bit over
calls of 1, 3 and 8 rows (streams joining and leaving; both within fp32 tolerance of the conventional path),
a call after warm-up never synchronises the host, and a kernel fault surfaces at the next call or check().
Needs an sm_90 GPU and libtilevox_kernels.so."""

from __future__ import annotations

import pytest
import torch

from tilevox.engine_builder.regions import TilingConfig, region_compiler
from tilevox.executor.megakernel import (
    BackendOptions,
    MegakernelCodePredictorLoop,
    MegakernelDecoderStep,
    MegakernelFaultError,
    MegakernelNhDecoderStep,
    MegakernelTalkerStep,
    install_megakernel_regions,
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
COMPILER = region_compiler()  # build-time code, handed to the run-time backends


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
    assert install_megakernel_regions(model, [DECODER_STEP], BackendOptions(compiler=COMPILER)) == {DECODER_STEP: None}
    model.token_observer = lambda _sid, tok: tokens["mk"].append(tok)
    synthesize(model, _request("Hello from the GPU"))
    assert len(tokens["ref"]) >= 10 and tokens["mk"] == tokens["ref"]
    assert model.decoder_step_backend.num_megakernel_calls == len(tokens["ref"]) - 1


def test_qwen3_fp32_greedy_frames_equal_conventional():
    model = _qwen3(torch.float32)
    frames: dict[str, list[torch.Tensor]] = {"ref": [], "mk": []}
    model.frame_observer = lambda _sid, codes: frames["ref"].append(codes)
    synthesize(model, _request("Good morning"))
    assert install_megakernel_regions(model, [TALKER_STEP, CODE_PREDICTOR_LOOP], BackendOptions(compiler=COMPILER)) == {
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
    backend = MegakernelDecoderStep(llama, BackendOptions(compiler=COMPILER))
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
    step = MegakernelTalkerStep(talker, BackendOptions(compiler=COMPILER))
    predictor = MegakernelCodePredictorLoop(talker.code_predictor, BackendOptions(compiler=COMPILER))
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
    tiling = TilingConfig(
        matvec_rows=24, lm_head_rows=100, heads_per_qkv_tile=2, partition_tokens=7, cross_attn_rows=2, attn_rows=2
    )
    backend = MegakernelNhDecoderStep(network, BackendOptions(compiler=region_compiler(tiling)))
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


# Calls of the bucket tests: streams join and leave; every bucket (1, 4, 8) is replayed after its first call.
BATCHES = (1, 3, 8, 3, 1, 8, 3)
GRAPHS = BackendOptions(compiler=COMPILER)  # buckets, CUDA graphs, deferred error check
EAGER = BackendOptions(compiler=COMPILER, sync_check=True)  # buckets, a synchronous check after every eager launch
NH_TILING = TilingConfig(
    matvec_rows=24, lm_head_rows=100, heads_per_qkv_tile=2, partition_tokens=7, cross_attn_rows=2, attn_rows=2
)
SLEEP_CYCLES = 2_000_000_000  # about one second of torch.cuda._sleep on an H200: far longer than a call


class _Case:
    """One region in three identical states: [0] a CUDA-graph backend, [1] an eager sync-check backend,
    [2] the conventional call. `inputs(index, batch)` makes a call's device inputs (it may synchronise);
    `call(which, inputs)` runs only the call; `done(inputs)` does the test's host bookkeeping after it."""

    def __init__(self, backends, reference) -> None:
        self.backends = backends
        self.reference = reference

    def inputs(self, index: int, batch: int):
        raise NotImplementedError

    def call(self, which: int, inputs) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def done(self, inputs) -> None:
        return None

    def state(self, which: int) -> tuple[torch.Tensor, ...]:
        return ()

    def check_reference(self, got: tuple[torch.Tensor, ...], reference: tuple[torch.Tensor, ...]) -> None:
        """The megakernel's outputs against the conventional call's, within fp32 tolerance."""
        for got_one, want in zip(got, reference, strict=True):
            torch.testing.assert_close(got_one, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def _rows(index: int, batch: int, total: int = 8) -> list[int]:
    """Distinct slots of call `index`: a window that moves, so streams join and leave between calls."""
    return [(3 * index + j) % total for j in range(batch)]


class _DecoderCase(_Case):
    def __init__(self) -> None:
        llama = _llasa().llama
        self.llama = llama
        gen = torch.Generator().manual_seed(11)
        self.gen = gen
        self.caches = [llama.new_cache(max_streams=8, max_seq_len=256) for _ in range(3)]
        keys, values = (
            torch.randn(self.caches[0].k.shape, generator=gen),
            torch.randn(self.caches[0].v.shape, generator=gen),
        )
        for cache in self.caches:
            for _ in range(8):
                cache.allocate()
            cache.k.copy_(keys)
            cache.v.copy_(values)
            cache.lengths[:] = [5, 17, 2, 30, 9, 12, 1, 40]
        super().__init__([MegakernelDecoderStep(llama, GRAPHS), MegakernelDecoderStep(llama, EAGER)], llama.decode)

    def inputs(self, index: int, batch: int):
        tokens = torch.randint(0, self.llama.config.vocab_size, (batch,), generator=self.gen).cuda()
        return _rows(index, batch), tokens

    def call(self, which: int, inputs):
        slots, tokens = inputs
        step = self.backends[which] if which < 2 else self.reference
        return (step(self.caches[which], slots, tokens),)

    def state(self, which: int):
        return self.caches[which].k, self.caches[which].v


class _TalkerCase(_Case):
    def __init__(self) -> None:
        talker = _qwen3(torch.float32).talker
        self.talker, self.hidden_size = talker, talker.config.transformer.hidden_size
        self.gen = torch.Generator().manual_seed(12)
        self.caches = [talker.new_cache(num_slots=8, max_len=256) for _ in range(3)]
        init = torch.randn(self.caches[0].keys.shape, generator=self.gen).cuda()
        for cache in self.caches:
            cache.keys.copy_(init)
            cache.values.copy_(init.flip(-1))
        self.positions = [7, 3, 21, 0, 11, 5, 30, 2]
        super().__init__([MegakernelTalkerStep(talker, GRAPHS), MegakernelTalkerStep(talker, EAGER)], None)

    def inputs(self, index: int, batch: int):
        slots = _rows(index, batch)
        start = [self.positions[s] for s in slots]
        x = torch.randn(batch, 1, self.hidden_size, generator=self.gen).cuda()
        return slots, torch.tensor(slots, device="cuda"), torch.tensor(start, device="cuda"), max(start) + 1, x

    def call(self, which: int, inputs):
        _, slots, start, kv_len, x = inputs
        view = CacheView(cache=self.caches[which], slots=slots, start=start, kv_len=kv_len)
        with torch.no_grad():
            return self.backends[which](x, view) if which < 2 else self.talker.forward_tokens(x, view)

    def done(self, inputs) -> None:
        for slot in inputs[0]:
            self.positions[slot] += 1

    def state(self, which: int):
        return self.caches[which].keys, self.caches[which].values


class _PredictorCase(_Case):
    """Greedy and sampled rows (the draws are counter-based: graph and eager draw the same codes); the
    conventional reference is greedy, compared on the greedy rows; no cache state (one of its own per bucket)."""

    def __init__(self) -> None:
        talker = _qwen3(torch.float32).talker
        self.predictor, self.hidden_size = talker.code_predictor, talker.config.transformer.hidden_size
        self.gen = torch.Generator().manual_seed(13)
        backends = [
            MegakernelCodePredictorLoop(self.predictor, GRAPHS),
            MegakernelCodePredictorLoop(self.predictor, EAGER),
        ]
        super().__init__(backends, None)

    def inputs(self, index: int, batch: int):
        params = tuple(
            SamplingParams.greedy() if j % 2 == 0 else SamplingParams(temperature=0.9, top_k=30) for j in range(batch)
        )
        rows = PredictorRows(
            params=params, seeds=tuple(100 + s for s in _rows(index, batch)), rng_offsets=(15 * index,) * batch
        )
        hidden = torch.randn(batch, self.hidden_size, generator=self.gen).cuda()
        code0 = torch.randn(batch, self.hidden_size, generator=self.gen).cuda()
        return hidden, code0, rows

    def call(self, which: int, inputs):
        hidden, code0, rows = inputs
        with torch.no_grad():
            if which < 2:
                return (self.backends[which](hidden, code0, lambda *_: pytest.fail("the predictor fell back"), rows),)
            head_logits: list[torch.Tensor] = []

            def choose(head: int, logits: torch.Tensor) -> torch.Tensor:
                head_logits.append(logits)
                return logits.float().argmax(-1)

            return self.predictor.predict(hidden, code0, choose), head_logits

    def check_reference(self, got, reference) -> None:
        """Greedy rows (the even ones) equal the conventional greedy codes up to the first head where the
        reference logits nearly tie (later heads follow from that choice)."""
        codes, head_logits = reference
        for row in range(0, codes.shape[0], 2):
            differs = torch.nonzero(got[0][row] != codes[row]).flatten().tolist()
            if differs:
                head = differs[0]
                _assert_near_tie(int(got[0][row, head]), head_logits[head][row], 2 * TOL[torch.float32])


class _NhCase(_Case):
    def __init__(self) -> None:
        network = random_network(network_config("nh-tts-tiny"), seed=1, device="cuda", dtype=torch.float32)
        self.network, config = network, network.config
        self.channels, self.vocab = config.decoder.num_channels, config.decoder.vocab_size
        self.gen = torch.Generator().manual_seed(14)
        self.caches = [network.new_cache(max_rows=8, max_seq_len=64, max_text_len=32) for _ in range(3)]
        rows = list(range(8))
        texts = [9, 1, 30, 17, 32, 4, 12, 25]
        encoded = torch.randn(8, 32, config.encoder.hidden_size, generator=self.gen).cuda()
        valid = (torch.arange(32)[None, :] < torch.tensor(texts)[:, None]).cuda()
        keys = torch.randn(self.caches[0].self_k.shape, generator=self.gen).cuda()
        for cache in self.caches:
            cache.claim(rows)
        network.decoder.write_cross(self.caches[0], rows, encoded, valid)
        for cache in self.caches:
            for name in ("cross_k", "cross_v", "text_lengths_device"):
                getattr(cache, name).copy_(getattr(self.caches[0], name))
            cache.text_lengths[:] = self.caches[0].text_lengths
            cache.self_k.copy_(keys)
            cache.self_v.copy_(keys.flip(-1))
            cache.lengths[:] = [6, 0, 17, 3, 9, 1, 12, 4]
        assert self.caches[0].text_lengths == texts
        options = [
            BackendOptions(compiler=region_compiler(NH_TILING)),
            BackendOptions(compiler=region_compiler(NH_TILING), sync_check=True),
        ]
        super().__init__([MegakernelNhDecoderStep(network, o) for o in options], network.step)

    def inputs(self, index: int, batch: int):
        return _rows(index, batch), torch.randint(0, self.vocab, (batch, 1, self.channels), generator=self.gen).cuda()

    def call(self, which: int, inputs):
        rows, codes = inputs
        step = self.backends[which] if which < 2 else self.reference
        with torch.no_grad():
            return (step(self.caches[which], rows, codes),)

    def state(self, which: int):
        return self.caches[which].self_k, self.caches[which].self_v


CASES = {
    "decoder_step": _DecoderCase,
    "talker_step": _TalkerCase,
    "code_predictor_loop": _PredictorCase,
    "nh_decoder_step": _NhCase,
}


@pytest.mark.parametrize("region", list(CASES))
def test_graph_replay_equals_eager_sync_check_bit_for_bit(region):
    """Calls of 1, 3, 8, 3, 1, 8, 3 rows over moving slots: the graph backend (buckets 1, 4, 8, each captured
    after its first call and replayed after) returns exactly the eager sync-check backend's outputs and
    leaves exactly its caches; both within fp32 tolerance of the conventional call."""
    case = CASES[region]()
    for index, batch in enumerate(BATCHES):
        inputs = case.inputs(index, batch)
        graphed, eager, reference = (case.call(which, inputs) for which in range(3))
        for got, want in zip(graphed, eager, strict=True):
            assert got.shape[0] == batch and torch.equal(got, want), f"call {index} (batch {batch})"
        case.check_reference(eager, reference)
        case.done(inputs)
    for got, want in zip(case.state(0), case.state(1), strict=True):
        assert torch.equal(got, want)
    graph_backend, eager_backend = case.backends
    graph_backend.check()
    eager_backend.check()
    assert {b: c.graph is not None for b, c in graph_backend._runner._compiled.items()} == {1: True, 4: True, 8: True}
    assert all(c.graph is None for c in eager_backend._runner._compiled.values())
    for backend in case.backends:
        assert backend.num_megakernel_calls == len(BATCHES) and backend.num_conventional_calls == 0


@pytest.mark.parametrize("region", list(CASES))
def test_a_call_never_synchronises_the_host(region):
    """After the bucket's warm-up (eager launch + capture, then a replay), a call under
    torch.cuda.set_sync_debug_mode("error") (any synchronising CUDA call raises) returns while the GPU is
    still busy with a long sleep enqueued before it; its result, once the GPU has caught up, is the eager
    sync-check backend's."""
    case = CASES[region]()
    for index in range(2):
        inputs = case.inputs(index, 3)
        case.call(0, inputs)
        case.call(1, inputs)
        case.done(inputs)
    inputs = case.inputs(2, 3)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = case.call(0, inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    returned = torch.cuda.Event()
    returned.record()
    assert not returned.query(), "the call waited for the GPU"
    torch.cuda.synchronize()
    case.backends[0].check()
    want = case.call(1, inputs)
    for got_one, want_one in zip(got, want, strict=True):
        assert got_one.shape[0] == 3 and torch.equal(got_one, want_one)
    assert case.backends[0]._runner._compiled[4].graph is not None


def test_a_kernel_fault_surfaces_at_the_next_call_and_in_check():
    """An out-of-range token: the graph backend's call returns (no synchronisation), check() raises the
    kernel's fault; after another faulty call has completed, the next call raises it before running and
    the call after that runs normally. With sync_check=True the faulty call itself raises."""
    case = _DecoderCase()
    backend, cache = case.backends[0], case.caches[0]
    vocab = case.llama.config.vocab_size
    slots, tokens = case.inputs(0, 3)
    backend(cache, slots, tokens)
    bad = tokens.clone()
    bad[1] = vocab + 7
    backend(cache, slots, bad)
    with pytest.raises(MegakernelFaultError, match="index out of range"):
        backend.check()
    backend(cache, slots, bad)
    torch.cuda.synchronize()
    lengths = list(cache.lengths)
    with pytest.raises(MegakernelFaultError, match="index out of range"):
        backend(cache, slots, tokens)
    assert cache.lengths == lengths and backend.num_megakernel_calls == 3  # the failing call ran nothing
    logits = backend(cache, slots, tokens)
    backend.check()
    assert backend.num_megakernel_calls == 4 and torch.isfinite(logits).all()
    eager, eager_cache = case.backends[1], case.caches[1]
    eager(eager_cache, slots, tokens)
    with pytest.raises(MegakernelFaultError, match="fault"):
        eager(eager_cache, slots, bad)
