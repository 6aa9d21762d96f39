"""Streaming audio encoders: model float32 samples in, bytes of one response format out.

Every encoder is incremental (`encode(samples)` then `finish()`), so audio leaves as soon as a
codec frame is complete. PCM, WAV and G.711 (mu-law / A-law) are byte-exact and stateless per
sample; MP3, Ogg/Opus, AAC (ADTS) and FLAC go through PyAV (FFmpeg's libmp3lame, libopus, aac and
flac) with per-packet flushing. Resampling uses soxr's streaming resampler so chunk boundaries
never click. `supported_rates(fmt)` is what each encoder can take (asked of FFmpeg), so a request for
another rate is refused up front, before any audio is made.

Streamed files cannot know their length when their header leaves: streamed WAV carries 0xFFFFFFFF
RIFF/data sizes (OpenAI's convention), streamed FLAC a STREAMINFO with total_samples = 0, which the FLAC
format defines as "unknown" (streaming decoders such as FFmpeg read it to the end; libsndfile does
not). `encode_all` (whole responses) writes exact headers for both.
Imports: numpy, soxr, soundfile, av.
"""

from __future__ import annotations

import enum
import functools
import io
import struct

import numpy as np
import soundfile
import soxr

from tilevox.models.errors import RequestError

__all__ = ["AudioFormat", "StreamEncoder", "encode_all", "float_to_pcm16", "streaming_wav_header", "supported_rates"]

MIN_SAMPLE_RATE_HZ = 8000
MAX_SAMPLE_RATE_HZ = 192000


class AudioFormat(enum.Enum):
    PCM = "pcm"  # raw s16le mono
    WAV = "wav"  # one RIFF header with 0xFFFFFFFF sizes, then s16le
    MP3 = "mp3"
    OPUS = "opus"  # Ogg/Opus
    FLAC = "flac"
    AAC = "aac"  # AAC-LC in ADTS frames (each frame self-contained, so it streams)
    MULAW = "mulaw"  # raw G.711 mu-law
    ALAW = "alaw"  # raw G.711 A-law

    @property
    def content_type(self) -> str:
        return _CONTENT_TYPES[self]

    @property
    def is_lossless(self) -> bool:
        return self in (AudioFormat.PCM, AudioFormat.WAV, AudioFormat.FLAC)


_CONTENT_TYPES = {
    AudioFormat.PCM: "audio/pcm",
    AudioFormat.WAV: "audio/wav",
    AudioFormat.MP3: "audio/mpeg",
    AudioFormat.OPUS: "audio/ogg",
    AudioFormat.FLAC: "audio/flac",
    AudioFormat.AAC: "audio/aac",
    AudioFormat.MULAW: "audio/basic",
    AudioFormat.ALAW: "audio/x-alaw-basic",
}


def float_to_pcm16(samples: np.ndarray) -> np.ndarray:
    """Clip to [-1, 1] and round to int16 (the one conversion every surface shares)."""
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)


def streaming_wav_header(sample_rate_hz: int) -> bytes:
    """A 44-byte mono s16le WAV header whose RIFF and data sizes are 0xFFFFFFFF (length unknown),
    the convention OpenAI's streamed WAV uses; players then read until end of stream."""
    byte_rate = sample_rate_hz * 2
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate_hz, byte_rate, 2, 16)
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


class _ChunkSink:
    """Write-only, non-seekable file object: FFmpeg muxers then emit a pure stream (no back-patching)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


# format -> (FFmpeg container, encoder, sample format the encoder takes)
_AV_CODECS: dict[AudioFormat, tuple[str, str, str]] = {
    AudioFormat.MP3: ("mp3", "libmp3lame", "s16p"),
    AudioFormat.OPUS: ("ogg", "libopus", "s16"),
    AudioFormat.FLAC: ("flac", "flac", "s16"),
    AudioFormat.AAC: ("adts", "aac", "fltp"),
}


@functools.cache
def supported_rates(fmt: AudioFormat) -> tuple[int, ...] | None:
    """The sample rates `fmt`'s encoder accepts, ascending (asked of FFmpeg through PyAV), or None when any
    rate in [MIN_SAMPLE_RATE_HZ, MAX_SAMPLE_RATE_HZ] works (PCM, WAV, FLAC; G.711 is fixed by the caller)."""
    if fmt not in _AV_CODECS:
        return None
    import av

    rates = av.codec.Codec(_AV_CODECS[fmt][1], "w").audio_rates
    return tuple(sorted(r for r in rates if MIN_SAMPLE_RATE_HZ <= r <= MAX_SAMPLE_RATE_HZ)) if rates else None


def check_rate(fmt: AudioFormat, rate_hz: int) -> None:
    """Raise RequestError (a ValueError) naming the accepted rates when `fmt` cannot be encoded at `rate_hz`."""
    if not (MIN_SAMPLE_RATE_HZ <= rate_hz <= MAX_SAMPLE_RATE_HZ):
        raise RequestError(f"sample rate {rate_hz} Hz is outside [{MIN_SAMPLE_RATE_HZ}, {MAX_SAMPLE_RATE_HZ}]")
    rates = supported_rates(fmt)
    if rates is not None and rate_hz not in rates:
        raise RequestError(f"{fmt.value} encodes only at {', '.join(map(str, rates))} Hz, got {rate_hz}")


class _AvEncoder:
    """PyAV container encoder that hands back whatever bytes each packet produced."""

    def __init__(self, fmt: AudioFormat, sample_rate_hz: int) -> None:
        import av  # imported lazily: only the compressed formats need FFmpeg

        self._av = av
        container_name, codec_name, sample_format = _AV_CODECS[fmt]
        options = {"flush_packets": "1"}
        if fmt is AudioFormat.OPUS:
            options["page_duration"] = "20000"  # one Ogg page per 20 ms packet, else pages wait ~1 s
        self._sink = _ChunkSink()
        self._container = av.open(self._sink, "w", format=container_name, options=options)
        self._stream = self._container.add_stream(codec_name, rate=sample_rate_hz)
        self._stream.layout = "mono"
        self._stream.format = sample_format  # PyAV converts the s16 frames below to it
        self._rate = sample_rate_hz

    def encode(self, pcm: np.ndarray) -> bytes:
        if pcm.size:
            frame = self._av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")  # (1, N)
            frame.sample_rate = self._rate
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.take()


class StreamEncoder:
    """Encode one stream of model audio into `fmt` at `out_rate_hz` (resampling if it differs)."""

    def __init__(self, fmt: AudioFormat, *, in_rate_hz: int, out_rate_hz: int | None = None) -> None:
        out_rate_hz = in_rate_hz if out_rate_hz is None else out_rate_hz
        check_rate(fmt, out_rate_hz)
        self.format = fmt
        self.sample_rate_hz = out_rate_hz
        self._resampler = (
            soxr.ResampleStream(in_rate_hz, out_rate_hz, 1, dtype="float32", quality="HQ")
            if out_rate_hz != in_rate_hz
            else None
        )
        self._header_sent = False
        self._av = _AvEncoder(fmt, out_rate_hz) if fmt in _AV_CODECS else None
        self._finished = False

    def _resample(self, samples: np.ndarray, last: bool) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32)
        if self._resampler is None:
            return samples
        return self._resampler.resample_chunk(samples, last=last)

    def _encode_pcm(self, samples: np.ndarray) -> bytes:
        pcm = float_to_pcm16(samples)
        if self.format in (AudioFormat.PCM, AudioFormat.WAV):
            out = pcm.astype("<i2").tobytes()
            if self.format is AudioFormat.WAV and not self._header_sent:
                out = streaming_wav_header(self.sample_rate_hz) + out
                self._header_sent = True
            return out
        if self.format in (AudioFormat.MULAW, AudioFormat.ALAW):
            if not pcm.size:
                return b""
            buf = io.BytesIO()
            subtype = "ULAW" if self.format is AudioFormat.MULAW else "ALAW"
            # RAW G.711 is one byte per sample with no state, so per-chunk encoding is exact.
            soundfile.write(buf, pcm, self.sample_rate_hz, format="RAW", subtype=subtype)
            return buf.getvalue()
        return self._av.encode(pcm)

    def encode(self, samples: np.ndarray) -> bytes:
        if self._finished:
            raise RuntimeError("encode() after finish()")
        return self._encode_pcm(self._resample(samples, last=False))

    def finish(self) -> bytes:
        """Flush resampler and codec; for WAV with no audio at all this still returns the header."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        out = self._encode_pcm(self._resample(np.zeros(0, dtype=np.float32), last=True))
        if self._av is not None:
            out += self._av.finish()
        self._finished = True
        return out


def encode_all(fmt: AudioFormat, samples: np.ndarray, *, in_rate_hz: int, out_rate_hz: int | None = None) -> bytes:
    """Encode a whole utterance at once (unary APIs, non-streamed responses). WAV and FLAC get exact
    length fields (written by libsndfile into a seekable buffer); the other formats carry none."""
    out_rate_hz = in_rate_hz if out_rate_hz is None else out_rate_hz
    if fmt in (AudioFormat.WAV, AudioFormat.FLAC):
        check_rate(fmt, out_rate_hz)
        samples = np.asarray(samples, dtype=np.float32)
        if out_rate_hz != in_rate_hz:
            samples = soxr.resample(samples, in_rate_hz, out_rate_hz, quality="HQ")
        buf = io.BytesIO()
        soundfile.write(buf, float_to_pcm16(samples), out_rate_hz, format=fmt.name, subtype="PCM_16")
        return buf.getvalue()
    enc = StreamEncoder(fmt, in_rate_hz=in_rate_hz, out_rate_hz=out_rate_hz)
    return enc.encode(samples) + enc.finish()
