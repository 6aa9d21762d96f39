"""Chunked streaming decode for the (non-causal) DAC decoder.

Aligned blocks of C frames: block [s, s+C) is decoded in the window [s - L, s + C + R) (clipped at 0)
and only its own C * hop samples are kept; the tail, at `flush`, is one window up to the true end.
Windows depend only on the frame count, so the audio does not depend on push sizes.

The decoder is convolutions only (zero "same" padding, no attention or normalization), so a sample
depends on the codes of a bounded span of frames around it: `decoder_reach_frames`, 10 frames back and
10 ahead for the 44.1 kHz codec (116 ms; the tiny preset has the same strides). With L and R at least
that reach (the defaults) streamed audio is the full-utterance decode up to float rounding. Measured
(benchmarks/dac_streaming_bound.py -> results/dac_streaming_bound.json, random dac-44khz and dac-tiny,
CPU): at L = R = 10, max abs error 1e-15 in fp64 and 1.7e-6 (SNR 119 dB) in fp32; one frame less on
either side leaves 1.7e-5 (SNR ~115 dB), two frames less 8e-3 (SNR ~60 dB), none 1.0 (SNR 6 dB).
Default C = 8: a frame's samples come out at worst C - 1 + R = 17 frames (197 ms) after its codes,
the first after C + R = 18 frames (209 ms); (L + C + R) / C = 3.5 frames decoded per frame emitted.

`push_many` advances several streams and decodes all their due blocks in one batched call of
right-padded windows (DacCodec.decode_windows masks each row to its length, so each stream gets what
its own `push` gives, up to float rounding). Imports: torch, numpy, models.dac, models.region_backends (the ChunkDecodeBackend protocol).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tilevox.models.dac.model import DacCodec, decoder_reach_frames
from tilevox.models.region_backends import ChunkDecodeBackend

__all__ = ["DEFAULT_CHUNK_FRAMES", "STREAM_MAX_ABS_ERROR", "DacStreamDecoder", "push_many"]

DEFAULT_CHUNK_FRAMES = 8
# Streamed vs full decode, fp32, with L and R at least the decoder's reach: measured max 2.8e-6 over
# utterances of 1..101 frames on random 44.1 kHz and tiny codecs; the margin covers other conv algorithms.
STREAM_MAX_ABS_ERROR = 1e-4


class DacStreamDecoder:
    """One utterance's codes, decoded as they arrive.

    Args:
        codec: the (eval-mode) codec.
        left_context: frames before a block that its window includes (default: the decoder's left reach).
        lookahead: frames after a block that must arrive before it is decoded (default: the right reach).
        chunk_frames: frames per decoded block (default 8).
    """

    def __init__(
        self,
        codec: DacCodec,
        *,
        left_context: int | None = None,
        lookahead: int | None = None,
        chunk_frames: int = DEFAULT_CHUNK_FRAMES,
    ) -> None:
        reach_left, reach_right = decoder_reach_frames(codec.config)
        self.codec = codec
        self.left_context = reach_left if left_context is None else left_context
        self.lookahead = reach_right if lookahead is None else lookahead
        self.chunk_frames = chunk_frames
        if self.left_context < 0 or self.lookahead < 0:
            raise ValueError(f"left_context and lookahead must be >= 0, got {self.left_context}, {self.lookahead}")
        if self.chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {self.chunk_frames}")
        self.hop_length = codec.hop_length
        # Codes of frames [self._buffer_start, self.num_frames), on the codec's device.
        self._buffer = torch.empty(codec.num_codebooks, 0, dtype=torch.long, device=codec.device)
        self._buffer_start = 0
        self._next_frame = 0  # first frame whose samples have not been emitted
        self._is_flushed = False

    @property
    def num_frames(self) -> int:
        """Frames pushed so far."""
        return self._buffer_start + self._buffer.shape[1]

    @property
    def num_emitted_frames(self) -> int:
        return self._next_frame

    @property
    def first_audio_frames(self) -> int:
        """Frames that must be pushed before `push` returns the first samples."""
        return self.chunk_frames + self.lookahead

    @property
    def latency_ms(self) -> float:
        """Worst-case delay from a frame's codes to its samples (block wait plus lookahead)."""
        return (self.chunk_frames - 1 + self.lookahead) * 1000.0 * self.hop_length / self.codec.sample_rate_hz

    def push(self, codes: torch.Tensor, *, check_range: bool = True) -> np.ndarray | None:
        """Append (n_q, k) int64 codes; return the float32 samples that became final, or None.
        check_range=False skips the range check (a host sync) for codes known to be valid."""
        return push_many([self], [codes], check_range=check_range)[0]

    def flush(self) -> np.ndarray:
        """End the utterance: return the samples of every frame not yet emitted (maybe none)."""
        if self._is_flushed:
            raise ValueError("flush called twice: this stream has ended")
        self._is_flushed = True
        if self._next_frame == self.num_frames:
            return np.zeros(0, dtype=np.float32)
        start, end, window_start, codes = self._window(self._next_frame, self.num_frames, self.num_frames)
        with torch.inference_mode():
            audio = self.codec.decode(codes.unsqueeze(0))[0]
        return self._emit(start, end, window_start, audio.float().cpu().numpy())

    def _append(self, codes: torch.Tensor, check_range: bool) -> None:
        if self._is_flushed:
            raise ValueError("push after flush: this stream has ended")
        n_q = self.codec.num_codebooks
        if codes.dim() != 2 or codes.shape[0] != n_q or codes.dtype != torch.long:
            raise ValueError(f"codes must be an int64 ({n_q}, frames) tensor, got {tuple(codes.shape)} {codes.dtype}")
        size = self.codec.codebook_size
        if check_range and codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= size):
            raise ValueError(f"codes must lie in [0, {size}), got [{int(codes.min())}, {int(codes.max())}]")
        self._buffer = torch.cat([self._buffer, codes.to(self._buffer.device)], dim=1)

    def _due_windows(self) -> list[tuple[int, int, int, torch.Tensor]]:
        """Blocks decodable now, in order: (start, end, window start, window codes (n_q, frames))."""
        due, start = [], self._next_frame
        while start + self.chunk_frames + self.lookahead <= self.num_frames:
            end = start + self.chunk_frames
            due.append(self._window(start, end, end + self.lookahead))
            start = end
        return due

    def _window(self, start: int, end: int, window_end: int) -> tuple[int, int, int, torch.Tensor]:
        window_start = max(0, start - self.left_context)
        codes = self._buffer[:, window_start - self._buffer_start : window_end - self._buffer_start]
        return start, end, window_start, codes

    def _emit(self, start: int, end: int, window_start: int, audio: np.ndarray) -> np.ndarray:
        """Keep frames [start, end) of a window's decoded samples and advance past them."""
        first = (start - window_start) * self.hop_length
        samples = audio[first : first + (end - start) * self.hop_length]
        self._next_frame = end
        keep_from = max(0, end - self.left_context)  # codes no later window reaches are dropped
        if keep_from > self._buffer_start:
            self._buffer = self._buffer[:, keep_from - self._buffer_start :]
            self._buffer_start = keep_from
        return samples


def push_many(
    streams: Sequence[DacStreamDecoder],
    codes: Sequence[torch.Tensor],
    *,
    check_range: bool = True,
    decode: ChunkDecodeBackend | None = None,
) -> list[np.ndarray | None]:
    """`push` codes[i] to streams[i] for every i, decoding all due blocks of the streams that share a
    codec in one call of `decode` (default: the codec's decode_windows; e.g. a captured graph of it, as
    models.xcodec2.streaming.start_push_many takes). Returns each stream's newly final float32 samples,
    or None."""
    if len(streams) != len(codes):
        raise ValueError(f"{len(streams)} streams for {len(codes)} code tensors")
    if len({id(s) for s in streams}) != len(streams):
        raise ValueError("each stream at most once per push_many")
    for stream, new in zip(streams, codes, strict=True):
        stream._append(new, check_range)
    jobs = [(row, window) for row, stream in enumerate(streams) for window in stream._due_windows()]
    by_codec: dict[int, list[int]] = {}
    for index, (row, _) in enumerate(jobs):
        by_codec.setdefault(id(streams[row].codec), []).append(index)
    audio: list[np.ndarray | None] = [None] * len(jobs)
    for indices in by_codec.values():
        codec = streams[jobs[indices[0]][0]].codec
        windows = [jobs[i][1][3] for i in indices]
        longest = max(w.shape[1] for w in windows)
        padded = torch.zeros(len(windows), codec.num_codebooks, longest, dtype=torch.long, device=codec.device)
        for slot, window in enumerate(windows):
            padded[slot, :, : window.shape[1]] = window
        lengths = torch.tensor([w.shape[1] for w in windows], dtype=torch.long, device=codec.device)
        with torch.inference_mode():
            decoded = (decode or codec.decode_windows)(padded, lengths).float().cpu().numpy()
        for slot, index in enumerate(indices):
            audio[index] = decoded[slot]
    pieces: list[list[np.ndarray]] = [[] for _ in streams]
    for index, (row, (start, end, window_start, _)) in enumerate(jobs):  # each stream's blocks in order
        pieces[row].append(streams[row]._emit(start, end, window_start, audio[index]))
    return [np.concatenate(p).astype(np.float32, copy=False) if p else None for p in pieces]
