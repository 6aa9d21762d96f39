"""Fair admission under overload (issue 19 item 7): 12 closed-loop clients on 4 running + 4 queued places.
Half wait as Retry-After says and send their ticket back; half retry at once without it, on their kept-alive
connection (which keeps their place: server/scheduler.py). Every client must get audio and the audio shares
must be even (Jain's fairness index >= 0.95 over a minute). Before the connection kept the place, the ticket
holders got about 1.35x the audio of the others and the index was 0.95-0.98 on 2 cores; now 1.00."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from tests.server.conftest import make_server
from tests.server.fake_model import FakeSpeechModel

WINDOW_S = float(os.environ.get("TILEVOX_FAIRNESS_WINDOW_S", "60"))


def jain_index(shares: list[float]) -> float:
    return sum(shares) ** 2 / (len(shares) * sum(x * x for x in shares)) if any(shares) else 0.0


def test_jain_index():
    assert jain_index([1, 1, 1, 1]) == 1.0
    assert jain_index([1, 0, 0, 0]) == 0.25


def _client(url: str, honours_retry_after: bool, deadline: float, audio_s: list, index: int) -> None:
    with httpx.Client(timeout=60) as client:
        ticket = None
        while time.monotonic() < deadline:
            headers = {"x-tilevox-ticket": ticket} if ticket else {}
            r = client.post(
                url, json={"input": "f" * 25, "response_format": "pcm", "sample_rate": 16000}, headers=headers
            )
            if r.status_code == 200:
                audio_s[index] += len(r.content) / 2 / 16000
                ticket = None
            elif r.status_code == 429:
                if honours_retry_after:
                    ticket = r.headers.get("x-tilevox-ticket")
                    wait_s = float(r.headers["retry-after-ms"]) / 1000  # as OpenAI's SDK reads it
                    time.sleep(min(wait_s, max(0.0, deadline - time.monotonic())))
                else:
                    time.sleep(0.01)  # "at once": no ticket, no wait beyond a breath
            else:
                raise AssertionError(f"unexpected {r.status_code}: {r.text[:200]}")


@pytest.mark.slow
def test_twelve_clients_on_four_plus_four_places_share_fairly():
    server = make_server(FakeSpeechModel(step_delay_s=0.01), max_streams=4, max_queued=4, warmup=False)
    try:
        url = server.http_url + "/v1/audio/speech"
        audio_s = [0.0] * 12
        deadline = time.monotonic() + WINDOW_S
        threads = [threading.Thread(target=_client, args=(url, i % 2 == 0, deadline, audio_s, i)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WINDOW_S + 60)
    finally:
        server.stop()
    assert all(s > 0 for s in audio_s), audio_s
    assert jain_index(audio_s) >= 0.95, (round(jain_index(audio_s), 3), [round(s, 1) for s in audio_s])
