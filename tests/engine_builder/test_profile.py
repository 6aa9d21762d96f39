"""engine_builder.profile on CPU: the build's steady streams open in batched prefills no larger than
MAX_PREFILL_BATCH (the memory KV capacity leaves free is sized for those, not for every stream at once),
and both timers run."""

from __future__ import annotations

import pytest
import torch

import tilevox.engine_builder.profile as profile
from tilevox.models.registry import load_model


def test_steady_streams_open_in_prefills_of_at_most_max_prefill_batch(monkeypatch):
    model = load_model("random:llama-tiny", device="cpu", dtype=torch.float32)
    monkeypatch.setattr(profile, "MAX_PREFILL_BATCH", 2)
    sizes = []
    open_streams = model.open_streams

    def recording(requests):
        sizes.append(len(requests))
        return open_streams(requests)

    monkeypatch.setattr(model, "open_streams", recording)
    streams = profile.SteadyStreams(model, 5, max_duration_s=1.0, text="Hello there, this is a test.")
    try:
        assert sizes == [2, 2, 1] and len(set(streams.ids)) == 5
        streams.step()
    finally:
        streams.close()
    assert model.open_stream_ids == ()  # every stream closed
    assert profile.region_times(model, 3, warmup=0, steps=1, max_duration_s=1.0)["decoder_step"] > 0
    record: list[float] = []
    mean = profile.step_time_ms(model, 3, warmup=0, steps=2, max_duration_s=1.0, record=record)
    assert len(record) == 2 and min(record) > 0 and mean == pytest.approx(sum(record) / 2)
    assert sizes[3:] == [2, 1, 2, 1]  # each timer opened its 3 streams in parts too


def test_warm_up_until_audio_passes_the_first_block_of_a_block_codec(monkeypatch):
    """Llasa gives no audio until a 5-frame block and its 8-frame lookahead have arrived: a warm-up of 4 steps
    ends inside that transient, one until first audio past it, and a cap bounds the wait."""
    model = load_model("random:llama-tiny", device="cpu", dtype=torch.float32)
    steps_run = []
    step = model.step

    def counting(ids):
        steps_run.append(len(ids))
        return step(ids)

    monkeypatch.setattr(model, "step", counting)
    for until_audio, max_extra in ((False, 48), (True, 48), (True, 3)):
        streams = profile.SteadyStreams(model, 3, max_duration_s=60.0)
        try:
            run = streams.warm_up(4, until_audio=until_audio, max_extra=max_extra)
            heard_all = streams.heard.issuperset(streams.ids)
        finally:
            streams.close()
        assert run == len(steps_run)
        if not until_audio:
            assert run == 4 and not heard_all
        elif max_extra == 48:
            assert 13 <= run <= 4 + 48 and heard_all
        else:
            assert run == 4 + 3 and not heard_all  # capped: 7 steps are still inside the first block
        steps_run.clear()


def test_settle_runs_untimed_steps_for_the_time_asked_and_closes_its_streams():
    model = load_model("random:llama-tiny", device="cpu", dtype=torch.float32)
    assert profile.settle(model, 2, 0.0, max_duration_s=1.0) == 0
    assert profile.settle(model, 2, 0.2, max_duration_s=1.0) >= 1
    assert profile.settle(model, 2, 10.0, max_duration_s=1.0, max_steps=3) == 3  # bounded by steps too
    assert model.open_stream_ids == ()
    with pytest.raises(ValueError, match="seconds"):
        profile.settle(model, 2, -1.0)
