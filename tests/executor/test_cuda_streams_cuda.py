"""Prefill and codec decode on CUDA streams of their own (models.cuda_streams, executor.install_prefill_stream
and install_codec_stream) on a GPU (skipped without one), for Qwen3-TTS and Llasa through the executor's graphs:

* open_streams never synchronises the host: with a long sleep queued on the prefill stream first, it
  returns while the new stream is not ready, and a step of the running stream returns meanwhile (the
  running streams never wait for an admission);
* a stream stepped before its prefill has finished waits for it on the device and gets the right numbers:
  every stream's frames (tokens) and audio equal, bit for bit, those of the same schedule on the same
  model without a prefill stream;
* the codec decode on its own stream, alone or with the prefill stream, gives the same frames (tokens) and
  audio, bit for bit, as the plain schedule.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tilevox.executor import GraphOptions, install_codec_stream, install_graph_regions, install_prefill_stream
from tilevox.models.llasa.loader import load_preset as load_llasa
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)", allow_module_level=True)

# The end of speech is held off for 12 tokens: random weights may otherwise stop a stream after 3 frames.
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_new_tokens=12)
HOLD_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second at the H100/H200's clocks


def _model(name: str, prefill_stream: bool, codec_stream: bool = False):
    if name == "qwen3":
        model = load_qwen3(
            "qwen3-tts-tiny", device="cuda", dtype=torch.bfloat16, options=ModelOptions(max_streams=4, max_seq_len=400)
        )
        observer = "frame_observer"
    else:
        model = load_llasa("llama-tiny", device="cuda", dtype=torch.bfloat16, max_streams=4, max_seq_len=600)
        observer = "token_observer"
    options = GraphOptions(prefill=True)
    install_graph_regions(model, options=options)
    if prefill_stream:
        assert install_prefill_stream(model, options) is None
    if codec_stream:
        assert install_codec_stream(model) is None
    return model, observer


def _schedule(model, observer: str, hold: bool) -> tuple[dict, dict]:
    """A opens and steps twice; B is admitted (with `hold`, behind a sleep queued on the prefill stream);
    A steps alone once more; then both step together to the end. Returns (what the schedule saw of B's
    readiness, per stream (frames or tokens, audio))."""
    first = SynthesisRequest(text="A running stream", sampling=SAMPLED, seed=3, max_duration_s=3.0)
    second = SynthesisRequest(text="An admission beside it", sampling=SAMPLED, seed=4, max_duration_s=2.0)
    seen: dict[int, list] = {}
    setattr(model, observer, lambda sid, x: seen.setdefault(sid, []).append(x.clone() if torch.is_tensor(x) else x))
    audio: dict[int, list[np.ndarray]] = {}

    def step(ids):
        for chunk in model.step(ids):
            audio.setdefault(chunk.stream_id, []).append(chunk.samples)

    a = model.open_stream(first)
    step([a])
    step([a])
    facts = {}
    if hold:
        with torch.cuda.stream(model.prefill_stream.stream):
            torch.cuda._sleep(HOLD_CYCLES)
    started = time.perf_counter()
    (b,) = model.open_streams([second])
    facts["open_s"] = time.perf_counter() - started
    facts["ready_after_open"] = model.is_ready(b)
    step([a])
    facts["ready_after_a_step"] = model.is_ready(b)
    while live := [i for i in (a, b) if i in model.open_stream_ids]:
        step(live)
    return facts, {name: (seen.get(i, []), np.concatenate(audio[i])) for name, i in (("a", a), ("b", b))}


@pytest.mark.parametrize(
    "name, streams",
    [
        ("qwen3", "prefill"),
        ("qwen3", "codec"),
        ("qwen3", "prefill+codec"),
        ("llasa", "codec"),
    ],  # Llasa: no prefill stream
)
def test_side_streams_overlap_and_match_the_plain_path(name, streams):
    plain, observer = _model(name, prefill_stream=False)
    _schedule(plain, observer, hold=False)  # warm: every graph of the schedule captured
    _, expected = _schedule(plain, observer, hold=False)

    prefill = "prefill" in streams
    model, _ = _model(name, prefill_stream=prefill, codec_stream="codec" in streams)
    _schedule(model, observer, hold=False)  # warm
    facts, got = _schedule(model, observer, hold=prefill)
    if prefill:
        # The host never waited for the prefill stream: open_streams returned and A stepped while the
        # sleep queued ahead of B's prefill still ran.
        assert not facts["ready_after_open"], facts
        assert not facts["ready_after_a_step"], facts
        assert facts["open_s"] < 0.5, facts
    for stream in ("a", "b"):
        (seen_got, audio_got), (seen_expected, audio_expected) = got[stream], expected[stream]
        assert len(seen_got) == len(seen_expected) > 3, stream
        for x, y in zip(seen_got, seen_expected):
            assert torch.equal(x, y) if torch.is_tensor(x) else x == y, stream
        np.testing.assert_array_equal(audio_got, audio_expected)
    if name == "qwen3" and prefill:  # its first tokens came from the prefill's own sampler, not the step's graphs
        assert model.prefill_stream.token_sampling_backend.graphs.num_graphs >= 1


def test_install_prefill_stream_gives_the_prefill_its_own_sampler():
    model, _ = _model("qwen3", prefill_stream=True)
    own = model.prefill_stream.token_sampling_backend
    assert own is not None and own is not model.token_sampling_backend
