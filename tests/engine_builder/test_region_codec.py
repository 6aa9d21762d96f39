"""Region compiler + megakernel VM against the Qwen3-TTS codec's sliding-window transformer (models.qwen3_tts
.speech_tokenizer, tiny preset with a short window, fp32): one frame per row and launch, rows at different
positions, far past the window so the twice-written ring cache wraps many times, equals
Transformer.forward(x, state) frame by frame; the static race check accepts every tiling."""

from __future__ import annotations

import pytest
import torch

from tests.models.qwen3_tts.speech_tokenizer.codec_case import short_window_codec
from tilevox.engine_builder.regions import RegionSpec, TilingConfig, compile_region
from tilevox.models.decoder_view import ModelFamily, decoder_view
from tilevox.trt_plugins.megakernel import SchedulePolicy, run_program
from tilevox.trt_plugins.megakernel.validate import check_program
from tilevox.trt_plugins.megakernel.vm import key_span

ATOL = 2e-5
WINDOW = 5
TILINGS = {
    "fused": TilingConfig(matvec_rows=12, partition_tokens=2, attn_rows=2),
    "split": TilingConfig(matvec_rows=12, partition_tokens=2, attn_rows=2, split_qkv=True),
    "one_partition": TilingConfig(matvec_rows=16, partition_tokens=8, reduce_single_partition=False, split_qkv=True),
}


@pytest.fixture(scope="module")
def decoder():
    return short_window_codec(WINDOW, seed=7, scale_seed=1)


def test_key_span_covers_the_window_contiguously():
    assert key_span(0, 7) == (7, 0)
    assert [key_span(4, n) for n in (1, 3, 4, 5, 7, 8, 9)] == [(1, 0), (3, 0), (4, 0), (4, 1), (4, 3), (4, 0), (4, 1)]
    # Position p lives at ring slots p % W and p % W + W: the span [phys, phys + keys) holds positions
    # length - keys .. length - 1 in order.
    for window in (3, 5):
        for length in range(1, 4 * window):
            keys, phys = key_span(window, length)
            held = {}
            for p in range(length):
                held[p % window] = held[p % window + window] = p
            assert [held[phys + j] for j in range(keys)] == list(range(length - keys, length))


def test_codec_view_declares_window_scales_and_projections(decoder):
    view = decoder_view(decoder.pre_transformer)
    assert view.family is ModelFamily.QWEN3_TTS_CODEC
    assert view.sliding_window == WINDOW and view.input_size == decoder.config.latent_dim
    assert view.output_projection[0] is decoder.pre_transformer.output_proj.weight
    assert all(layer.attn_layer_scale is not None and layer.qk_norm is None for layer in view.layers)


@pytest.mark.parametrize("tiling_name", list(TILINGS))
def test_codec_transformer_region_matches_the_streaming_transformer(decoder, tiling_name):
    """Three rows at different positions (0, 3 and 11 frames in), then 3 x WINDOW + 2 frames together: the
    region's x_out equals Transformer.forward of the same frame with a DecoderState, every frame. A one-row
    region over the same three-slot cache decodes each row's first frames alone (slots name the rows)."""
    transformer = decoder.pre_transformer
    batch, frames, starts = 3, 3 * WINDOW + 2, (0, 3, 11)
    tiling = TILINGS[tiling_name]
    region = compile_region(transformer, RegionSpec(lm_head=True), batch_size=batch, tiling=tiling, num_sms=4)
    single = compile_region(
        transformer, RegionSpec(lm_head=True), batch_size=1, num_cache_slots=batch, tiling=tiling, num_sms=3
    )
    for compiled in (region, single):
        check_program(compiled.program)
        assert compiled.program.constants.window == WINDOW
    shape = region.program.buffer("k_cache").shape
    assert shape == single.program.buffer("k_cache").shape and shape[3] == 2 * WINDOW
    # NaN-poisoned caches: a read of a ring slot no frame has written yet shows up in x_out.
    caches = {"k_cache": torch.full(shape, float("nan")), "v_cache": torch.full(shape, float("nan"))}
    gen = torch.Generator().manual_seed(3)
    history = torch.randn(batch, max(starts) + frames, decoder.config.latent_dim, generator=gen)
    state = decoder.new_state(batch)
    with torch.no_grad():
        for row, start in enumerate(starts):
            alone = decoder.new_state(1)
            for t in range(start):
                ref = transformer(history[row : row + 1, t : t + 1], alone)[:, 0]
                alone.positions.add_(1)
                out = run_program(
                    single.program,
                    {
                        **single.weights,
                        "x_in": history[row : row + 1, t],
                        "positions": torch.tensor([t]),
                        "slots": torch.tensor([row]),
                        **caches,
                    },
                )
                torch.testing.assert_close(out["x_out"], ref, atol=ATOL, rtol=0)
            state.put([row], alone)
        for t in range(frames):
            x = torch.stack([history[row, starts[row] + t] for row in range(batch)])
            ref = transformer(x[:, None], state)[:, 0]
            state.positions.add_(1)
            out = run_program(
                region.program,
                {
                    **region.weights,
                    "x_in": x,
                    "positions": torch.tensor(starts) + t,
                    "slots": torch.arange(batch),
                    **caches,
                },
                policy=SchedulePolicy.RANDOM,
                seed=t,
            )
            torch.testing.assert_close(out["x_out"], ref, atol=ATOL, rtol=0)
    assert not caches["k_cache"].isnan().any()  # every position of the ring was written (each row wrapped)


def test_codec_region_refuses_a_context_other_than_its_window_and_a_short_ring(decoder):
    transformer = decoder.pre_transformer
    with pytest.raises(ValueError, match="window"):
        compile_region(transformer, RegionSpec(lm_head=True), batch_size=1, max_context=WINDOW + 1)
    with pytest.raises(ValueError, match="ring"):
        compile_region(transformer, RegionSpec(lm_head=True), batch_size=1, cache_len=2 * WINDOW - 1)


def test_codec_benchmark_smoke_on_cpu_with_the_vm(tmp_path, capsys):
    """benchmarks/megakernel_codec.py on CPU (VM, fp32 tiny decoder): its ring caches, filled from the
    DecoderState's earlier frames, give the conventional step's output, and whole frames decoded through the
    region give decode_incremental's samples; JSON and table written."""
    import json

    from benchmarks import megakernel_codec

    out = tmp_path / "codec.json"
    argv = ["--device", "cpu", "--executor", "vm", "--preset", "tiny", "--dtype", "float32", "--batches", "1,3"]
    assert megakernel_codec.main([*argv, "--no-compile", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["batch"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["region_max_abs_diff"] < 1e-5 and row["region_max_abs_diff_vs_fp32"] < 1e-5
        assert row["accuracy_passed"] and row["accuracy_frames"] == 16
        # The whole frame with the region in place of the transformer (decode_front, region, decode_back).
        assert row["frame_max_abs_sample_diff"] < 1e-5 and row["frame_sample_scale"] > 0.05
        assert "ms" in row["megakernel_eager"] and "ms" in row["transformer_eager"]
        # As served: the executor's decode_slots against the megakernel backend, the same frame from one state.
        assert "ms" in row["served_decode_graph"] and "ms" in row["served_decode_megakernel"]
        assert row["served_max_abs_sample_diff"] < 1e-5
    assert "| 3 |" in capsys.readouterr().out and out.with_suffix(".md").exists()
