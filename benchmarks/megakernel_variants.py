"""Same-run A/B of megakernel build variants: one kernel library per setting of the build-time switches in
trt_plugins/csrc/megakernel/ (TILEVOX_MK_POLL, _RELEASE, _INFLIGHT, _ACQUIRE, _ATTN_SPLIT, _EARLY_POLL,
_OP_NOINLINE, _WEIGHT_L1, _QKV_INFLIGHT, _REPEAT_ATTN, _FRESH_SPREAD), or `LIB@TILING` for library LIB compiled with
another tiling (TILINGS), each timed and profiled by `benchmarks.megakernel_profile` in its own process on one GPU,
and checked bitwise against the default build's outputs (the switches change waits, releases, load depth and which
warp computes what, never arithmetic; TILEVOX_MK_ATTN_SPLIT reorders attention's fp32 sums, so its variants are
checked against the VM by the GPU tests instead).

    # here (nvcc, no GPU): after `python -m tilevox.trt_plugins.build` (reuses its other objects)
    python -m benchmarks.megakernel_variants build --out .mkvariants
    # on the GPU, carrying .mkvariants:
    python -m benchmarks.megakernel_variants run --libs .mkvariants --out $OUT/variants.json

A variant named rev-COMMIT is that commit's megakernel (built from a git worktree), to compare a change of the
kernel with the kernel before it in one run; its outputs may differ in fp32 order, like ATTN_SPLIT's.

Writes per variant the profile JSON (graph replay medians per batch, per-opcode summary, critical path)
and a table; `run` exits 1 when a variant's outputs differ from the default's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

VARIANTS: dict[str, dict[str, int]] = {
    "default": {},
    "relaxed": {"TILEVOX_MK_ACQUIRE": 0},
    "nosplit": {"TILEVOX_MK_ATTN_SPLIT": 0},
    "adaptive": {"TILEVOX_MK_ATTN_SPLIT": 2},
    "repeatattn": {"TILEVOX_MK_REPEAT_ATTN": 1},  # a diagnostic (common.cuh): ATTN_PARTIAL run twice
    "freshspread": {"TILEVOX_MK_FRESH_SPREAD": 1},  # split QKV's query heads and key normed by one warp each
    "early": {"TILEVOX_MK_EARLY_POLL": 1},
    "early+relaxed": {"TILEVOX_MK_EARLY_POLL": 1, "TILEVOX_MK_ACQUIRE": 0},
    "inline": {"TILEVOX_MK_OP_NOINLINE": 0},
    "relaxed+poll": {"TILEVOX_MK_ACQUIRE": 0, "TILEVOX_MK_POLL": 1},
    "relaxed+inflight2": {"TILEVOX_MK_ACQUIRE": 0, "TILEVOX_MK_INFLIGHT": 2},
    "poll": {"TILEVOX_MK_POLL": 1},
    "release": {"TILEVOX_MK_RELEASE": 1},
    "inflight2": {"TILEVOX_MK_INFLIGHT": 2},
    "noalloc": {"TILEVOX_MK_WEIGHT_L1": 0},
    "qkv2": {"TILEVOX_MK_QKV_INFLIGHT": 2},
}
# Compile-side variants: `LIB@TILING` runs library LIB with benchmarks.megakernel_profile's extra flags
# TILINGS[TILING] (other tile sizes sum in another fp32 order: checked against the VM by the GPU tests).
TILINGS: dict[str, list[str]] = {
    "plain": ["--sm-balanced", "off", "--attn-rows", "0"],  # the tiling before 2026-12-06 (16-row tiles, all rows)
    "balanced": ["--sm-balanced", "on", "--attn-rows", "0"],
    "attn4": ["--attn-rows", "4"],
    "attn8": ["--attn-rows", "8"],
    "attn16": ["--attn-rows", "16"],
    "onepart": ["--reduce-single-partition", "off"],  # one-partition regions without ATTN_REDUCE (default since 12-07)
    "reduce": ["--reduce-single-partition", "on", "--attn-rows", "0"],  # the default tiling before 2026-12-07 15:30
    "onepart_attn4": ["--reduce-single-partition", "off", "--attn-rows", "4"],
    "onepart_attn8": ["--reduce-single-partition", "off", "--attn-rows", "8"],
    "affinity": ["--opcode-affinity", "on"],  # each instruction on the SM that ran its opcode last
    "onepart_affinity": ["--reduce-single-partition", "off", "--opcode-affinity", "on"],
    "split": ["--split-qkv", "on"],  # balanced q/k/v tiles; norms and rope in ATTN_PARTIAL, KV_APPEND beside it
    "fused": ["--split-qkv", "off"],  # one whole head per QKV tile
}
# Variants whose outputs may differ from the default's in fp32 summation order (checked against the VM by
# the GPU tests instead of bit for bit).
REORDERED = ("TILEVOX_MK_ATTN_SPLIT",)


def _split(variant: str) -> tuple[str, list[str]]:
    """(library variant, extra profile flags) of a variant name."""
    lib, _, tiling = variant.partition("@")
    return lib, TILINGS[tiling] if tiling else []


def _lib_name(variant: str) -> str:
    return f"libtilevox_kernels_{_split(variant)[0].replace('+', '_')}.so"


def build(out: Path, names: list[str], jobs: int) -> None:
    from tilevox.trt_plugins import build as kb

    nvcc = kb.find_nvcc()
    includes = [*kb.find_cutlass_include_dirs(), kb.CSRC_DIR]
    cfg = kb.BuildConfig()
    sources = kb.list_sources()
    mk = [s for s in sources if s.stem == "megakernel"]
    others = [kb._object_path(cfg, s) for s in sources if s.stem != "megakernel"]
    missing = [str(o) for o in others if not o.exists()]
    if len(mk) != 1 or missing:
        raise SystemExit(f"build the default library first (python -m tilevox.trt_plugins.build); missing: {missing}")
    out.mkdir(parents=True, exist_ok=True)

    def one(name: str) -> None:
        defines = [f"-D{k}={v}" for k, v in VARIANTS.get(name, {}).items()]
        source, incs = mk[0], includes
        if name.startswith("rev-"):  # the megakernel of an earlier commit, same switches as its default
            tree = out / name
            if not tree.exists():
                subprocess.run(["git", "worktree", "add", "--detach", str(tree), name[4:]], check=True)
            csrc = tree / "trt_plugins" / "csrc"
            source, incs = csrc / "megakernel" / "megakernel.cu", [*includes[:-1], csrc]
        obj = out / f"megakernel_{name.replace('+', '_')}.o"
        cmd = [nvcc, *kb.NVCC_FLAGS, *defines, *(f"-I{d}" for d in incs), "-c", str(source), "-o", str(obj)]
        subprocess.run(cmd, check=True)
        lib = out / _lib_name(name)
        link = [nvcc, "-shared", "-gencode", "arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC", str(obj)]
        subprocess.run([*link, *map(str, others), "-o", str(lib)], check=True)
        obj.unlink()
        if name.startswith("rev-"):
            subprocess.run(["git", "worktree", "remove", "--force", str(out / name)], check=True)
        print(f"built {lib} ({' '.join(defines) or 'defaults'})", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, names))


def run(libs: Path, out: Path, names: list[str], batches: str, commit: str, extra: list[str]) -> int:
    results: dict[str, dict] = {}
    for name in names:
        lib = libs / _lib_name(name)
        prof = out.with_name(f"{out.stem}_{name.replace('+', '_').replace('@', '_at_')}.json")
        env = {**os.environ, "TILEVOX_KERNELS_LIB": str(lib.resolve())}
        cmd = [sys.executable, "-m", "benchmarks.megakernel_profile", "--out", str(prof), "--batches", batches]
        cmd += ["--commit", commit, "--fingerprint", *extra, *_split(name)[1]]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        print(f"== {name}: rc {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}", flush=True)
        if proc.returncode == 0:
            results[name] = json.loads(prof.read_text())
    failures = 0
    base = results.get("default")
    table = [
        "| variant | " + " | ".join(f"batch {r['batch']} ms" for r in (base or {}).get("rows", [])) + " | outputs |"
    ]
    table.append("|---" * (2 + len((base or {}).get("rows", []))) + "|")
    for name, res in results.items():
        # Compared with the default library at the same tiling when that ran (LIB@T against default@T), else with
        # the default itself.
        tiling = name.partition("@")[2]
        ref_name = f"default@{tiling}" if tiling and f"default@{tiling}" in results else "default"
        ref = results.get(ref_name)
        same = ref is not None and all(
            a["fingerprint"] == b["fingerprint"] for a, b in zip(res["rows"], ref["rows"], strict=True)
        )
        lib = _split(name)[0]
        reordered = (
            name.startswith("rev-")
            or (ref_name == "default" and "@" in name)
            or any(k in REORDERED for k in VARIANTS.get(lib, {}))
        )
        failures += 0 if same or reordered else 1
        verdict = f"= {ref_name}" if same else ("reordered sums (GPU tests vs the VM)" if reordered else "DIFFER")
        cells = [f"{r['graph_ms_no_prefetch']:.3f}" for r in res["rows"]]
        table.append(f"| {name} | " + " | ".join(cells) + f" | {verdict} |")
    missing = [n for n in names if n not in results]
    failures += len(missing)
    text = "\n".join(table)
    print(text + (f"\nfailed to run: {missing}" if missing else ""))
    out.write_text(
        json.dumps(
            {
                "benchmark": "megakernel build variants (benchmarks.megakernel_profile per variant; its model in each result)",
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "commit": commit,
                "variants": {
                    n: {**VARIANTS.get(_split(n)[0], {"source": _split(n)[0][4:]}), "profile_flags": _split(n)[1]}
                    for n in names
                },
                "results": results,
                "table": text,
                "failed": missing,
            },
            indent=2,
        )
    )
    return 1 if failures else 0


def _known(variant: str) -> bool:
    lib, _, tiling = variant.partition("@")
    return (lib in VARIANTS or lib.startswith("rev-")) and (not tiling or tiling in TILINGS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--variants", default=",".join(VARIANTS))
    b.add_argument("--jobs", type=int, default=2)
    r = sub.add_parser("run")
    r.add_argument("--libs", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--variants", default=",".join(VARIANTS))
    r.add_argument("--batches", default="1,8,32")
    r.add_argument("--commit", default="unknown")
    args, extra = parser.parse_known_args()
    names = args.variants.split(",")
    unknown = [n for n in names if not _known(n)]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}, each optionally @{'/@'.join(TILINGS)}")
    if args.cmd == "build":
        build(args.out, sorted({_split(n)[0] for n in names}), args.jobs)
        return 0
    return run(args.libs, args.out, names, args.batches, args.commit, extra)


if __name__ == "__main__":
    sys.exit(main())
