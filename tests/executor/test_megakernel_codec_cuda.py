"""The Qwen3-TTS codec decode with its sliding-window transformer as a megakernel region on the GPU (CUDA
executor, fp32 tiny codec with a 5-frame window so every ring wraps): streams kept as rows of one pool, stepped in
varying groups and frame counts through the region (CUDA graphs of the whole call, and eager launches with
sync_check), alone and alternating with the conventional decode_slots, each decode to their full decode within
fp32 tolerance (TF32 off); rows no call names stay as they were; a call after warm-up
never synchronises the host. Needs an sm_90 GPU and libtilevox_kernels.so."""

from __future__ import annotations

import pytest
import torch

from tests.executor.test_megakernel_codec import FRAMES, WINDOW, _codes, _stream_pool
from tests.models.qwen3_tts.speech_tokenizer.codec_case import short_window_codec
from tilevox.engine_builder.regions import region_compiler
from tilevox.executor.megakernel import BackendOptions, MegakernelCodecDecode

pytestmark = [pytest.mark.gpu, pytest.mark.requires_megakernel]

TOL = 1e-4  # relative to the samples' scale (fp32, TF32 off)


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 convolutions without TF32 (cuDNN's default), so the region's fp32 error is what the comparison sees."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def codec():
    return short_window_codec(WINDOW, seed=11, scale_seed=2, device="cuda")


def _close(decoder, pool, others, samples, codes) -> None:
    for slot, got in samples.items():
        ref = decoder(codes[slot])
        assert (got - ref).abs().max().item() <= TOL * max(ref.abs().max().item(), 1e-3)
    assert pool.positions.tolist() == [0, FRAMES, FRAMES, 0, FRAMES, 0]
    for (mine, _), (theirs, _) in zip(pool.select([0, 3, 5])._tensors(), others._tensors(), strict=True):
        assert torch.equal(mine, theirs)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["graphs", "sync_check", "alternating"])
def test_codec_region_streams_equal_their_full_decode_on_the_gpu(codec, mode):
    options = BackendOptions(compiler=region_compiler(), sync_check=mode == "sync_check")
    backend = MegakernelCodecDecode(codec, options)
    use_region = (lambda step: step % 2 == 0) if mode == "alternating" else (lambda step: True)
    _close(codec, *_stream_pool(codec, backend, use_region, seed=5, device="cuda"))
    backend.check()
    assert backend.num_megakernel_calls >= 4 and backend.num_conventional_calls == 0
    if mode == "graphs":
        assert backend._graphs.num_graphs >= 2


@torch.no_grad()
def test_a_codec_call_never_synchronises_the_host(codec):
    backend = MegakernelCodecDecode(codec, BackendOptions(compiler=region_compiler()))
    pool = codec.new_state(4)
    codes = _codes(codec.config, 4, seed=3).cuda().expand(2, -1, -1).contiguous()
    slots = torch.tensor([2, 0], device="cuda")
    backend(codes[..., :1], pool, slots)  # warm-up: compile, bind, capture
    backend(codes[..., 1:2], pool, slots)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = backend(codes[..., 2:3], pool, slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref_pool = codec.new_state(4)
    ref = codec.decode_slots(codes[..., :3], ref_pool, slots)
    backend.check()
    scale = ref.abs().max().item()
    assert (out - ref[:, -out.shape[1] :]).abs().max().item() <= TOL * max(scale, 1e-3)
    assert pool.positions.tolist() == [3, 0, 3, 0]
