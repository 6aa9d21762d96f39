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

__all__ = [
    "REPO",
    "RESULTS",
    "ServerProcess",
    "add_executor_args",
    "add_tiling_args",
    "apply_executor_args",
    "apply_tiling_args",
    "commit",
    "device_name",
    "free_port",
    "utc_now",
]

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


def add_executor_args(parser) -> None:
    """--device / --executor / --num-sms of the megakernel benchmarks (see apply_executor_args)."""
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--executor", default="cuda", choices=["cuda", "vm"])
    parser.add_argument("--num-sms", type=int, default=None, help="queues (default: the GPU's SMs; 8 on CPU)")


def apply_executor_args(parser, args) -> None:
    """Checks add_executor_args' flags (parser.error on a bad combination) and resolves them in place: args.device a
    torch.device with an explicit index (the megakernel binding compares devices, and cuda != cuda:0), args.num_sms
    the GPU's SM count unless given (8 on CPU)."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA GPU is visible")
    args.device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if args.executor == "cuda" and args.device.type != "cuda":
        parser.error("--executor cuda needs --device cuda")
    if args.num_sms is None:
        args.num_sms = (
            torch.cuda.get_device_properties(args.device).multi_processor_count if args.device.type == "cuda" else 8
        )


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
