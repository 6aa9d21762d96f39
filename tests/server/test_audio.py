"""Streaming encoders: byte-exact PCM/WAV/G.711, lossless FLAC round trip, decodable MP3/Opus,
chunked encoding equal to one-shot encoding, and resampling through soxr."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest
import soundfile
import soxr

from tilevox.server.audio import AudioFormat, StreamEncoder, encode_all, float_to_pcm16, streaming_wav_header


def _signal(n: int, rate: int) -> np.ndarray:
    rng = np.random.default_rng()
    t = np.arange(n) / rate
    return (0.4 * np.sin(2 * np.pi * rng.uniform(150, 900) * t) + 0.05 * rng.standard_normal(n)).astype(np.float32)


def _chunked(fmt: AudioFormat, x: np.ndarray, in_rate: int, out_rate: int | None = None) -> bytes:
    enc = StreamEncoder(fmt, in_rate_hz=in_rate, out_rate_hz=out_rate)
    rng = np.random.default_rng()
    out, i = [], 0
    while i < len(x):
        n = int(rng.integers(0, 900))  # includes empty chunks
        out.append(enc.encode(x[i : i + n]))
        i += n
    out.append(enc.finish())
    return b"".join(out)


def _av_decode(data: bytes) -> tuple[np.ndarray, int]:
    container = av.open(io.BytesIO(data))
    frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
    rate = container.streams.audio[0].rate
    return np.concatenate(frames), rate


@pytest.mark.parametrize("rate", [16000, 24000])
def test_pcm_and_wav_are_exact_and_chunking_invariant(rate):
    x = _signal(4321, rate)
    expected = float_to_pcm16(x)
    pcm = _chunked(AudioFormat.PCM, x, rate)
    np.testing.assert_array_equal(np.frombuffer(pcm, "<i2"), expected)
    wav = _chunked(AudioFormat.WAV, x, rate)
    assert wav[:44] == streaming_wav_header(rate)
    assert wav.count(b"RIFF") == 1  # exactly one header however many chunks
    riff, size, wave, fmt_tag = struct.unpack("<4sI4s4s", wav[:16])
    assert (riff, size, wave, fmt_tag) == (b"RIFF", 0xFFFFFFFF, b"WAVE", b"fmt ")
    assert struct.unpack("<HHI", wav[20:28]) == (1, 1, rate)
    np.testing.assert_array_equal(np.frombuffer(wav[44:], "<i2"), expected)


def test_whole_wav_has_exact_sizes():
    """encode_all (whole responses) knows the length: RIFF and data sizes are exact, unlike the streamed header."""
    empty = encode_all(AudioFormat.WAV, np.zeros(0, np.float32), in_rate_hz=16000)
    assert struct.unpack("<4sI4s", empty[:12]) == (b"RIFF", 36, b"WAVE") and empty[-8:] == b"data" + struct.pack(
        "<I", 0
    )
    tone = np.sin(np.arange(1000, dtype=np.float32) / 7)
    wav = encode_all(AudioFormat.WAV, tone, in_rate_hz=16000)
    assert struct.unpack("<I", wav[4:8])[0] == len(wav) - 8 and struct.unpack("<I", wav[40:44])[0] == 2000
    np.testing.assert_array_equal(np.frombuffer(wav[44:], "<i2"), float_to_pcm16(tone))


def test_pcm16_conversion_clips_and_rounds():
    x = np.array([-2.0, -1.0, -0.5, 0.0, 1e-6, 0.5, 1.0, 3.0], dtype=np.float32)
    np.testing.assert_array_equal(float_to_pcm16(x), [-32767, -32767, -16384, 0, 0, 16384, 32767, 32767])


@pytest.mark.parametrize("rate", [16000, 24000])
def test_flac_stream_is_lossless(rate):
    x = _signal(9000, rate)
    decoded, out_rate = _av_decode(_chunked(AudioFormat.FLAC, x, rate))
    assert out_rate == rate
    np.testing.assert_array_equal(decoded.astype(np.int16), float_to_pcm16(x))


@pytest.mark.parametrize("fmt", [AudioFormat.MP3, AudioFormat.OPUS])
def test_lossy_streams_decode_to_the_signal(fmt):
    rate = 24000
    x = _signal(rate, rate)
    data = _chunked(fmt, x, rate)
    y, out_rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert out_rate == rate
    # codecs add priming delay: align by cross-correlation, then compare energy-normalised
    lag = int(np.argmax(np.correlate(y[: rate // 2], x[:2000], mode="valid")))
    seg = y[lag : lag + len(x) // 2]
    ref = x[: len(seg)]
    corr = float(np.dot(seg, ref) / np.linalg.norm(seg) / np.linalg.norm(ref))
    assert corr > 0.9, corr


def test_opus_bytes_flow_before_finish():
    enc = StreamEncoder(AudioFormat.OPUS, in_rate_hz=16000)
    got = sum(len(enc.encode(_signal(320, 16000))) for _ in range(10))  # 200 ms in 20 ms chunks
    assert got > 0  # pages are flushed per packet, not held until the end


@pytest.mark.parametrize("fmt,subtype", [(AudioFormat.MULAW, "ULAW"), (AudioFormat.ALAW, "ALAW")])
def test_g711_matches_soundfile_reference_at_8k(fmt, subtype):
    x = _signal(7777, 24000)
    data = _chunked(fmt, x, 24000, 8000)
    resampled = soxr.resample(x, 24000, 8000, quality="HQ")
    ref = io.BytesIO()
    soundfile.write(ref, float_to_pcm16(resampled), 8000, format="RAW", subtype=subtype)
    # streamed resampling equals one-shot resampling up to float rounding: allow 1 code in 1000
    a, b = np.frombuffer(data, np.uint8), np.frombuffer(ref.getvalue(), np.uint8)
    assert abs(len(a) - len(b)) <= 1
    n = min(len(a), len(b))
    assert np.mean(a[:n] != b[:n]) < 1e-3


@pytest.mark.parametrize("in_rate,out_rate", [(16000, 44100), (24000, 22050), (16000, 8000)])
def test_resampled_pcm_matches_soxr_one_shot(in_rate, out_rate):
    x = _signal(12345, in_rate)
    got = np.frombuffer(_chunked(AudioFormat.PCM, x, in_rate, out_rate), "<i2").astype(np.int32)
    ref = float_to_pcm16(soxr.resample(x, in_rate, out_rate, quality="HQ")).astype(np.int32)
    assert abs(len(got) - len(ref)) <= 1
    n = min(len(got), len(ref))
    assert np.max(np.abs(got[:n] - ref[:n])) <= 2


def test_encoder_validation():
    with pytest.raises(ValueError, match="outside"):
        StreamEncoder(AudioFormat.PCM, in_rate_hz=16000, out_rate_hz=4000)
    with pytest.raises(ValueError, match="opus"):
        StreamEncoder(AudioFormat.OPUS, in_rate_hz=16000, out_rate_hz=44100)
    enc = StreamEncoder(AudioFormat.PCM, in_rate_hz=16000)
    enc.finish()
    with pytest.raises(RuntimeError):
        enc.encode(np.zeros(3, np.float32))
