"""What every benchmark needs: where a result came from (commit, device, date) and a `tilevox serve`
started as a subprocess on free loopback ports (tilevox.server.bench.ServerProcess)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

from tilevox.server.bench import (  # `tilevox serve` as a subprocess, as `tilevox bench` starts it
    ServerProcess,
    free_port,
)

__all__ = ["REPO", "RESULTS", "ServerProcess", "commit", "device_name", "free_port", "utc_now"]

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def commit() -> str:
    """The checkout's short commit, with `-dirty` when it has uncommitted changes; $TILEVOX_COMMIT where the
    copy has no git history (the device machine)."""
    if os.environ.get("TILEVOX_COMMIT"):
        return os.environ["TILEVOX_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{cpu} ({os.cpu_count()} cores)"


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def add_tiling_args(parser) -> None:
    """--sm-balanced / --attn-rows / --reduce-single-partition / --split-qkv / --opcode-affinity: TilingConfig
    overrides for the megakernel benchmarks (see apply_tiling_args)."""
    parser.add_argument(
        "--sm-balanced",
        choices=["on", "off"],
        default=None,
        help="TilingConfig.sm_balanced: one matrix-vector tile per SM and stage (default: TilingConfig's)",
    )
    parser.add_argument(
        "--attn-rows", type=int, default=None, help="TilingConfig.attn_rows (0: all rows; default: TilingConfig's)"
    )
    parser.add_argument(
        "--reduce-single-partition",
        choices=["on", "off"],
        default=None,
        help="TilingConfig.reduce_single_partition: an ATTN_REDUCE stage even for one partition (default: TilingConfig's)",
    )
    parser.add_argument(
        "--split-qkv",
        choices=["on", "off"],
        default=None,
        help="TilingConfig.split_qkv: balanced q/k/v projection tiles, norms and rope in the attention (default: TilingConfig's)",
    )
    parser.add_argument(
        "--opcode-affinity",
        choices=["on", "off"],
        default=None,
        help="TilingConfig.opcode_affinity: each instruction on the SM that ran its opcode last (default: TilingConfig's)",
    )


def apply_tiling_args(tiling, args):
    """`tiling` with the add_tiling_args overrides that were given."""
    import dataclasses

    if args.sm_balanced is not None:
        tiling = dataclasses.replace(tiling, sm_balanced=args.sm_balanced == "on")
    if args.attn_rows is not None:
        tiling = dataclasses.replace(tiling, attn_rows=args.attn_rows or None)
    if args.reduce_single_partition is not None:
        tiling = dataclasses.replace(tiling, reduce_single_partition=args.reduce_single_partition == "on")
    if args.split_qkv is not None:
        tiling = dataclasses.replace(tiling, split_qkv=args.split_qkv == "on")
    if args.opcode_affinity is not None:
        tiling = dataclasses.replace(tiling, opcode_affinity=args.opcode_affinity == "on")
    return tiling
