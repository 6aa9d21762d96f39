"""`tilevox bench`: the stall and gap arithmetic on hand-made arrival traces, and a small end-to-end run
(closed and open loop) against a started CPU server that writes the JSON report and the PNG."""

from __future__ import annotations

import json
import socket

import pytest

from tilevox.server.bench import SERVER_COUNTERS, free_port, parse_counters, request_result, server_counters
from tilevox.server.cli import main

RATE = 16000
ONE_S = 2 * RATE  # bytes of one second of s16 audio


def test_free_port_is_bindable_and_outside_the_kernels_ephemeral_range():
    """Ports from bind(0) can be handed to another process before our server binds them; ours cannot."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split())
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # random, so that concurrent test processes do not pick the same one
    for port in ports:
        assert not low <= port <= high and port >= 20000  # Ray's worker ports end at 19999
    with socket.socket() as s:  # and it really is free
        s.bind(("127.0.0.1", ports.pop()))


def test_gaps_and_stalls():
    # First audio at 0.1 s (1 s of audio), the next chunk 0.9 s later: the player still had audio.
    smooth = request_result([(0.05, 0), (0.1, ONE_S), (1.0, ONE_S), (1.9, ONE_S)], RATE, 2.0)
    assert smooth.ttfa_s == 0.1 and smooth.stalls == 0 and smooth.audio_s == 3.0
    assert smooth.max_gap_s == pytest.approx(0.9)
    # 0.5 s of audio, then nothing for 0.8 s: the buffer ran dry once; later chunks keep up.
    stalled = request_result([(0.2, ONE_S // 2), (1.0, ONE_S), (1.5, ONE_S)], RATE, 1.6)
    assert stalled.stalls == 1 and stalled.max_gap_s == pytest.approx(0.8)
    assert stalled.rtf == pytest.approx(1.6 / 2.5)
    silent = request_result([(0.1, 0)], RATE, 0.2)
    assert silent.ttfa_s is None and silent.audio_s == 0 and silent.rtf is None


def test_server_counters_over_a_level():
    text = "\n".join(f"{name} {value}" for name, value in zip(SERVER_COUNTERS, (10, 0.5, 40, 2, 0.1, 8)))
    before = parse_counters(text + "\n# HELP tilevox_steps_total ...\nother_total 3")
    after = {name: value * 3 for name, value in before.items()}
    got = server_counters(before, after, elapsed_s=2.0)
    assert got == {
        "steps": 20,
        "step_ms_mean": 50.0,
        "streams_per_step_mean": 4.0,
        "prefills": 4,
        "prefill_ms_mean": 50.0,
        "admissions_per_prefill_mean": 4.0,
        "step_share": 0.5,
        "prefill_share": 0.1,
    }
    assert server_counters({}, after, 2.0) is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["closed", "open"])
def test_bench_writes_a_report_and_a_plot(tmp_path, capsys, mode):
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "random:llama-tiny", "--device", "cpu", "--levels", "1,2", "--mode", mode]
    argv += [
        "--rounds",
        "1",
        "--min-requests",
        "1",
        "--rate",
        "4",
        "--duration",
        "1",
        "--max-duration",
        "0.5",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == mode and report["model"] == "random:llama-tiny"
    assert [lv["streams"] for lv in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert level["errors"] == 0 and level["requests"] >= 1
        assert 0 < level["ttfa_ms_p50"] <= level["ttfa_ms_p95"] <= level["ttfa_ms_p99"]
        assert level["audio_s_per_s"] > 0 and level["stalls"] >= 0
        server = level["server"]  # the started server's own counters over the level
        assert server["steps"] >= 1 and server["prefills"] >= 1 and server["admissions_per_prefill_mean"] >= 1
        assert server["step_ms_mean"] > 0 and 0 < server["step_share"] + server["prefill_share"] <= 1.0
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2 streams: TTFA p50" in capsys.readouterr().out
