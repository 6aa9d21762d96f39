"""Region compiler + megakernel VM against models.qwen3_tts (tiny preset, fp32): the whole code-predictor
loop of a frame as one region equals CodePredictor.predict (greedy and seeded sampling), and a talker
step with its codec head equals Talker.forward_tokens for streams at different positions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tilevox.engine_builder.regions import RegionSpec, TilingConfig, compile_region
from tilevox.executor.megakernel_inputs import code_predictor_inputs, sampling_inputs
from tilevox.models.qwen3_tts.config import Qwen3TTSConfig
from tilevox.models.qwen3_tts.layers import CacheView
from tilevox.models.qwen3_tts.loader import preset_config_dict, randomize_network_
from tilevox.models.qwen3_tts.talker import Talker
from tilevox.models.sampling import SamplingParams, filter_top_k_top_p
from tilevox.trt_plugins.megakernel import SchedulePolicy, run_program, uniform_from_seed

ATOL = 2e-5
TILING = TilingConfig(matvec_rows=20, lm_head_rows=12, heads_per_qkv_tile=3, partition_tokens=3, attn_rows=2)


def _tiny_talker(*, same_width: bool) -> Talker:
    """The tiny preset (predictor narrower than the talker: input projection, like the 1.7B), or with the
    predictor widened to the talker's width (no projection, like the 0.6B)."""
    config_dict = preset_config_dict("qwen3-tts-tiny")
    if same_width:
        talker_dict = config_dict["talker_config"]
        talker_dict["code_predictor_config"]["hidden_size"] = talker_dict["hidden_size"]
    model = Talker(Qwen3TTSConfig.from_dict(config_dict).talker).eval().requires_grad_(False)
    randomize_network_(model, seed=3)
    return model


@pytest.fixture(scope="module")
def talker() -> Talker:
    return _tiny_talker(same_width=False)


def _frame_inputs(talker: Talker, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, talker.config.transformer.hidden_size, generator=gen)
    code0 = torch.randint(0, talker.config.num_audio_codes, (batch,), generator=gen)
    return hidden, talker.embed_codec(code0)


@pytest.mark.parametrize(
    "batch, same_width, split_qkv",
    [(1, False, False), (3, False, False), (5, False, True), (2, True, False), (2, True, True)],
)
def test_code_predictor_loop_region_matches_predict_greedy(talker, batch, same_width, split_qkv):
    """The loop region (fused QKV, or split QKV: per-head q/k norms and rope in the attention and KV_APPEND)
    equals predict() step by step."""
    talker = _tiny_talker(same_width=True) if same_width else talker
    predictor = talker.code_predictor
    assert (predictor.small_to_mtp_projection is None) == same_width
    hidden, code0_emb = _frame_inputs(talker, batch, seed=batch)
    ref_logits: list[torch.Tensor] = []

    def choose(step_idx: int, logits: torch.Tensor) -> torch.Tensor:
        ref_logits.append(logits)
        return logits.argmax(-1)

    with torch.no_grad():
        ref_codes = predictor.predict(hidden, code0_emb, choose)
    region = compile_region(
        predictor,
        RegionSpec.code_predictor_loop(),
        batch_size=batch,
        tiling=dataclasses.replace(TILING, split_qkv=split_qkv),
        num_sms=5,
    )
    assert region.num_steps == predictor.num_steps + 1  # one micro-step per position 0..Q-1
    cache = predictor.new_cache(batch)
    greedy = sampling_inputs([SamplingParams.greedy()] * batch, seeds=[0] * batch)
    out = run_program(
        region.program,
        {**code_predictor_inputs(region, cache, hidden, code0_emb), **greedy},
        policy=SchedulePolicy.RANDOM,
        seed=batch,
    )
    for head in range(predictor.num_steps):
        torch.testing.assert_close(out[f"s{head + 1}.logits"], ref_logits[head], atol=ATOL, rtol=1e-5)
    codes = torch.stack([out[f"s{head + 1}.tokens"] for head in range(predictor.num_steps)], dim=1)
    assert torch.equal(codes, ref_codes)


def test_code_predictor_loop_region_seeded_sampling(talker):
    """Rows with different temperature / top-k / top-p: each draw equals the inverse-CDF draw of the
    counter-based uniform (seed, rng_offset + head) over models.sampling's filtered distribution, with
    the reference predictor fed the same choices."""
    predictor = talker.code_predictor
    batch = 4
    params = [
        SamplingParams(temperature=0.9, top_k=50, top_p=1.0),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.7, top_k=0, top_p=0.8),
        SamplingParams.greedy(),
    ]
    seeds, offsets = [11, 2**40 + 3, 7, 0], [0, 100, 5, 9]
    hidden, code0_emb = _frame_inputs(talker, batch, seed=21)
    inputs = sampling_inputs(params, seeds, offsets)

    def choose(step_idx: int, logits: torch.Tensor) -> torch.Tensor:
        draws = []
        for row, p in enumerate(params):
            if p.is_greedy:
                draws.append(int(logits[row].argmax()))
                continue
            probs = filter_top_k_top_p(logits[row].float() / p.temperature, p.top_k, p.top_p).softmax(-1)
            u = uniform_from_seed(
                inputs["seed"][row : row + 1],
                inputs["rng_offset"][row : row + 1] + step_idx,
            )
            cdf = probs.cumsum(-1)
            draws.append(int(torch.searchsorted(cdf, u * cdf[-1], right=True)))
        return torch.tensor(draws)

    with torch.no_grad():
        ref_codes = predictor.predict(hidden, code0_emb, choose)
    region = compile_region(
        predictor,
        RegionSpec.code_predictor_loop(),
        batch_size=batch,
        tiling=TILING,
        num_sms=3,
    )
    cache = predictor.new_cache(batch)
    out = run_program(
        region.program,
        {**code_predictor_inputs(region, cache, hidden, code0_emb), **inputs},
    )
    codes = torch.stack([out[f"s{head + 1}.tokens"] for head in range(predictor.num_steps)], dim=1)
    assert torch.equal(codes, ref_codes)


def test_talker_step_with_codec_head_matches_forward_tokens(talker):
    """Three streams prefilled to 1, 6 and 13 tokens in slots 2, 0, 3 decode one talker step together;
    the region's final-norm hidden and codec logits equal Talker.forward_tokens."""
    config = talker.config.transformer
    slots, lengths = [2, 0, 3], [1, 6, 13]
    gen = torch.Generator().manual_seed(5)
    cache = talker.new_cache(num_slots=4, max_len=24)
    with torch.no_grad():
        for slot, length in zip(slots, lengths):
            view = CacheView(
                cache=cache,
                slots=torch.tensor([slot]),
                start=torch.zeros(1, dtype=torch.long),
                kv_len=length,
                write_offset=0,
            )
            talker.forward_tokens(torch.randn(1, length, config.hidden_size, generator=gen), view)
    vm_keys, vm_values = cache.keys.clone(), cache.values.clone()
    inputs = torch.randn(3, config.hidden_size, generator=gen)
    start = torch.tensor(lengths)
    with torch.no_grad():
        ref_hidden, ref_logits = talker.forward_tokens(
            inputs[:, None],
            CacheView(cache=cache, slots=torch.tensor(slots), start=start, kv_len=24),
        )
    region = compile_region(
        talker,
        RegionSpec.layers(0, config.num_layers, lm_head=True),
        batch_size=3,
        max_context=24,
        num_cache_slots=4,
        tiling=TILING,
        num_sms=4,
    )
    bound = {
        **region.weights,
        "x_in": inputs,
        "positions": start,
        "slots": torch.tensor(slots),
        "k_cache": vm_keys,
        "v_cache": vm_values,
        **sampling_inputs([SamplingParams.greedy()] * 3, seeds=[0, 0, 0]),
    }
    out = run_program(region.program, bound)
    torch.testing.assert_close(out["x_normed"], ref_hidden, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(out["s0.logits"], ref_logits, atol=ATOL, rtol=1e-5)
    assert torch.equal(out["s0.tokens"], ref_logits.argmax(-1))
    torch.testing.assert_close(vm_keys, cache.keys, atol=ATOL, rtol=1e-5)
    # vocab_limit: sampling only among the audio codes (the control-id block on top is never drawn).
    limited = compile_region(
        talker,
        RegionSpec(lm_head=True, vocab_limit=talker.config.num_audio_codes),
        batch_size=3,
        max_context=24,
        num_cache_slots=4,
        tiling=TILING,
        num_sms=4,
    )
    bound["k_cache"], bound["v_cache"] = cache.keys.clone(), cache.values.clone()
    bound["positions"] = start + 1
    out = run_program(limited.program, bound)
    assert torch.equal(out["s0.tokens"], out["s0.logits"][:, : talker.config.num_audio_codes].argmax(-1))
    assert out["s0.logits"].shape[1] == talker.config.vocab_size
    assert (out["s0.logits"].argmax(-1) >= talker.config.num_audio_codes).any()  # the limit changed a choice


def test_predictor_loop_needs_the_kv_chain(talker):
    """Micro-steps 0 and 1 take independent inputs: only the KV chain orders step 1's attention after
    step 0's K/V append. The static check passes the compiled loop and flags it without the chain."""
    from tilevox.trt_plugins.megakernel import Opcode
    from tilevox.trt_plugins.megakernel.validate import ProgramError, check_program

    program = compile_region(
        talker.code_predictor, RegionSpec.code_predictor_loop(), batch_size=2, tiling=TILING, num_sms=4
    ).program
    check_program(program)
    qkv_counters = {i.signal for i in program.instructions if i.opcode is Opcode.RMSNORM_QKV_ROPE_APPEND}
    no_chain = tuple(
        dataclasses.replace(i, waits=tuple(w for w in i.waits if w.counter_id not in qkv_counters))
        if i.opcode is Opcode.RMSNORM_QKV_ROPE_APPEND
        else i
        for i in program.instructions
    )
    with pytest.raises(ProgramError, match=r"race: #\d+ ATTN_PARTIAL reads k_cache"):
        check_program(program.with_instructions(no_chain))


def test_rope_scaling_reaches_the_megakernel_or_refuses_it():
    """The region adapter takes the talker's RoPE frequencies with rope_scaling applied (linear x2 halves
    them) and refuses a scaling the kernel cannot express (yarn's cos/sin factor)."""
    from tilevox.models.decoder_view import decoder_view

    base = Qwen3TTSConfig.from_dict(preset_config_dict("qwen3-tts-tiny")).talker
    plain = decoder_view(Talker(base)).inv_freq
    scaling = base.transformer.rope_scaling
    linear = dataclasses.replace(
        base,
        transformer=dataclasses.replace(
            base.transformer, rope_scaling=dataclasses.replace(scaling, rope_type="linear", factor=2.0)
        ),
    )
    torch.testing.assert_close(decoder_view(Talker(linear)).inv_freq, plain / 2)
    yarn = dataclasses.replace(
        base,
        transformer=dataclasses.replace(
            base.transformer, rope_scaling=dataclasses.replace(scaling, rope_type="yarn", factor=4.0)
        ),
    )
    with pytest.raises(ValueError, match="yarn"):
        decoder_view(Talker(yarn))
