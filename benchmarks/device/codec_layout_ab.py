"""A/B of the Qwen3-TTS codec decode as served (executor.graphs.GraphedCodecDecode: decode_slots of a pool's rows
from one CUDA graph) with the codec state's two key/value layouts, side by side in one process on one GPU:

- A, `shifted`: the layout before 971fa20, the last window-1 frames per layer oldest first, shifted by a copy
  every frame, every ring copied out of the pool and back by decode_slots;
- B, `ring`: the twice-written ring the megakernel region binds (one tensor per K/V over all layers), read
  without a gather and written in place by slot.

A's decoder is models/qwen3_tts/speech_tokenizer/decoder.py as it was at 3f0a486, loaded from a file the run
writes beside this script (`git show 3f0a486:models/qwen3_tts/speech_tokenizer/decoder.py >
benchmarks/device/_decoder_3f0a486.py`, not committed); both get the same random bf16 12 Hz weights. Every
stream is 100 frames in; a pool of 2 x batch rows, every other row decoding one frame. CUDA events, medians;
the samples of the first call from the same codes are compared (the layouts must agree).

    python -m benchmarks.device.codec_layout_ab --batches 1,8,32,64 --out codec_layout.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

from benchmarks.common import device_name, utc_now
from benchmarks.timing import median_ms
from tilevox.executor.graphs import GraphedCodecDecode
from tilevox.models.qwen3_tts.speech_tokenizer import PRESETS, random_speech_tokenizer

OLD = Path(__file__).with_name("_decoder_3f0a486.py")
START_FRAME = 100


def _old_module():
    spec = importlib.util.spec_from_file_location("tilevox_decoder_3f0a486", OLD)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _pools(shifted, ring, rows: int):
    """A pool of `rows` streams for each decoder holding the same earlier frames (random keys and values of frames
    START - window + 1 .. START - 1: A's oldest first, B's at ring slots p % W and p % W + W)."""
    a, b = shifted.new_state(rows), ring.new_state(rows)
    gen = torch.Generator().manual_seed(rows)
    window = b.keys.shape[3] // 2
    for held, ring_tensor in ((a.keys, b.keys), (a.values, b.values)):
        for layer, tensor in enumerate(held):
            tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor))
            for j in range(window - 1):
                p = START_FRAME - (window - 1) + j
                for slot in (p % window, p % window + window):
                    ring_tensor[layer, :, :, slot].copy_(tensor[:, :, j])
    a.positions.fill_(START_FRAME)
    b.positions.fill_(START_FRAME)
    return {"shifted": a, "ring": b}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="12hz")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ring, _ = random_speech_tokenizer(PRESETS[args.preset], seed=0, device=device, dtype=dtype, with_encoder=False)
    shifted = _old_module().SpeechTokenizerDecoder(ring.config).to(device=device, dtype=dtype)
    shifted.load_state_dict(ring.state_dict())
    cfg = ring.config
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        gen = torch.Generator().manual_seed(batch)
        codes = torch.randint(0, cfg.codebook_size, (batch, cfg.num_quantizers, 1), generator=gen).to(device)
        slots = torch.arange(0, 2 * batch, 2, device=device)
        row, first = {"batch": batch}, {}
        pools = _pools(shifted, ring, 2 * batch)
        with torch.no_grad():
            for name, decoder in (("shifted", shifted), ("ring", ring)):
                backend, pool = GraphedCodecDecode(decoder), pools[name]
                first[name] = backend(codes, pool, slots).float()  # captures
                row[f"{name}_ms"] = median_ms(
                    lambda backend=backend, pool=pool, codes=codes, slots=slots: backend(codes, pool, slots),
                    iters=args.iters,
                    warmup=args.warmup,
                    device=device,
                )
        row["ring_over_shifted"] = row["ring_ms"] / row["shifted_ms"]
        row["first_call_samples_max_abs_diff"] = (first["ring"] - first["shifted"]).abs().max().item()
        rows.append(row)
        print(json.dumps(row))
    report = {
        "benchmark": "codec_layout_ab",
        "device": device_name(device.type),
        "date": utc_now(),
        "commit": args.commit,
        "torch": torch.__version__,
        "start_frame": START_FRAME,
        "rows": rows,
    }
    lines = ["| batch | shifted (A) ms | ring (B) ms | B / A |", "|---|---|---|---|"]
    lines += [
        f"| {r['batch']} | {r['shifted_ms']:.3f} | {r['ring_ms']:.3f} | {r['ring_over_shifted']:.3f} |" for r in rows
    ]
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
