"""How much left context L and lookahead R the DAC streaming decode needs: chunked vs full decode.

For each codec (random `dac-tiny` and `dac-44khz`, seeded), decode 64 frames of random codes whole,
then decode blocks of C = 8 frames inside windows [s - L, s + C + R), sweeping L with R = 12 and R
with L = 12, in fp32 (what is served) and fp64 (separates truncation from float
rounding: a window covering the decoder's reach gives exactly the full decode's float64 samples up to
~1e-15). Reports max abs error and SNR (null: exact) of the block's samples per L and R, the decoder's analytic reach
(`decoder_reach_frames`), then streams utterances of awkward lengths with the defaults through
DacStreamDecoder and reports their error against the full decode. CPU only; ~2 minutes on 2 cores.

    .venv/bin/python -m benchmarks.dac_streaming_bound [--out benchmarks/results/dac_streaming_bound.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import RESULTS, commit
from tilevox.models.dac import DAC_PRESETS, DacStreamDecoder, decoder_reach_frames, random_dac

FRAMES = 64
CHUNK = 8
WIDE = 12  # the context held fixed while the other side is swept (beyond the decoder's reach)
# The decoder is shift-invariant in whole frames, so block position only matters near the edges: the
# tiny codec checks three positions, the 44.1 kHz one (seconds per fp64 window on a CPU) one.
BLOCK_STARTS = {"dac-tiny": (20, 28, 36), "dac-44khz": (28,)}
SWEEP = tuple(range(0, WIDE + 1))
STREAM_LENGTHS = (1, 7, 33, 101)
PUSH_SIZES = (1, 3, 2, 7)


def _error(block: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    diff = block - reference
    energy = float(np.square(diff).sum())
    snr = math.inf if energy == 0.0 else 10.0 * math.log10(float(np.square(reference).sum()) / energy)
    return float(np.abs(diff).max()), snr


def _finite(snr: float) -> float | None:
    """JSON has no infinity: an exact match (no error energy) is written as null."""
    return snr if math.isfinite(snr) else None


def _window_error(codec, codes, full, left: int, right: int, starts) -> tuple[float, float]:
    """Worst max abs error and SNR over the blocks at `starts`, decoded in their [s-L, s+C+R) windows."""
    hop, worst_abs, worst_snr = codec.hop_length, 0.0, math.inf
    for start in starts:
        window_start = max(0, start - left)
        with torch.inference_mode():
            audio = codec.decode(codes[:, :, window_start : start + CHUNK + right])[0].double().numpy()
        first = (start - window_start) * hop
        max_abs, snr = _error(audio[first : first + CHUNK * hop], full[start * hop : (start + CHUNK) * hop])
        worst_abs, worst_snr = max(worst_abs, max_abs), min(worst_snr, snr)
    return worst_abs, worst_snr


def _sweep(codec, codes, starts) -> dict:
    with torch.inference_mode():
        full = codec.decode(codes)[0].double().numpy()
    rows = {"left": [], "right": []}
    for value in SWEEP:
        for side, (left, right) in (("left", (value, WIDE)), ("right", (WIDE, value))):
            max_abs, snr = _window_error(codec, codes, full, left, right, starts)
            rows[side].append({"frames": value, "max_abs_error": max_abs, "snr_db": _finite(snr)})
    return rows


def _stream_errors(codec, seed: int) -> list[dict]:
    out = []
    for frames in STREAM_LENGTHS:
        gen = torch.Generator().manual_seed(seed * 1000 + frames)
        codes = torch.randint(0, codec.codebook_size, (codec.num_codebooks, frames), generator=gen)
        stream, pieces, pos, index = DacStreamDecoder(codec), [], 0, 0
        while pos < frames:
            size = PUSH_SIZES[index % len(PUSH_SIZES)]
            pieces.append(stream.push(codes[:, pos : pos + size]))
            pos, index = pos + size, index + 1
        pieces.append(stream.flush())
        streamed = np.concatenate([p for p in pieces if p is not None]).astype(np.float64)
        with torch.inference_mode():
            full = codec.decode(codes[None])[0].double().numpy()
        max_abs, snr = _error(streamed, full)
        out.append({"frames": frames, "max_abs_error": max_abs, "snr_db": _finite(snr)})
    return out


def _min_exact(rows: list[dict], tolerance: float) -> int | None:
    """Smallest swept context from which every larger one is within `tolerance`."""
    best = None
    for row in reversed(rows):
        if row["max_abs_error"] > tolerance:
            break
        best = row["frames"]
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "dac_streaming_bound.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "frames": FRAMES,
        "chunk_frames": CHUNK,
        "block_starts": BLOCK_STARTS,
        "fixed_context_frames": WIDE,
        "codecs": {},
    }
    for preset in ("dac-tiny", "dac-44khz"):
        config = DAC_PRESETS[preset]
        reach_left, reach_right = decoder_reach_frames(config)
        entry = {"reach_frames": {"left": reach_left, "right": reach_right}}
        codes = torch.randint(
            0, config.codebook_size, (1, config.n_codebooks, FRAMES), generator=torch.Generator().manual_seed(0)
        )
        for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
            codec = random_dac(config, seed=0, dtype=dtype)
            rows = _sweep(codec, codes, BLOCK_STARTS[preset])
            entry[str(dtype).removeprefix("torch.")] = {
                "sweep": rows,
                "exact_from": {side: _min_exact(rows[side], tolerance) for side in rows},
                "exact_tolerance": tolerance,
            }
            print(preset, dtype, entry[str(dtype).removeprefix("torch.")]["exact_from"], flush=True)
        seeds = (0, 1, 2) if preset == "dac-tiny" else (0,)
        entry["streamed_default"] = {
            str(seed): _stream_errors(random_dac(config, seed=seed), seed=seed) for seed in seeds
        }
        worst = max(row["max_abs_error"] for rows in entry["streamed_default"].values() for row in rows)
        entry["streamed_default_max_abs_error"] = worst
        print(preset, "streamed with defaults: max abs error", worst, flush=True)
        result["codecs"][preset] = entry
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
