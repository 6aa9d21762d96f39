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
