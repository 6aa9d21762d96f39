"""What the Ray Serve path costs against the single-process server, on this machine's CPU, in one run.

Both servers are started with the same `tilevox serve` options (random:llama-tiny, --max-streams 8), one
after the other: the single process, then `--ray --num-replicas 1` (one replica: the cost of the extra hops,
Ray's proxy -> the ingress -> the replica, not scale-out). Each gets `tilevox bench`'s closed-loop levels
(server/bench.py run_level: streaming POST /v1/audio/speech, pcm) at 1 and 8 streams. Writes one JSON:

    .venv/bin/python -m benchmarks.ray_overhead_cpu --out benchmarks/results/ray_overhead_cpu_<commit>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time
from pathlib import Path

from tilevox.server.bench import ServerProcess, run_level
from tilevox.server.protocol import OPENAI_PCM_RATE_HZ

SERVE_ARGS = ["--model", "random:llama-tiny", "--device", "cpu", "--max-streams", "8"]
PATHS = {"single_process": [], "ray_1_replica": ["--ray", "--num-replicas", "1"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--levels", default="1,8")
    parser.add_argument("--rounds", type=int, default=6, help="requests per client per level")
    parser.add_argument("--max-duration", type=float, default=2.0, help="seconds of audio per request")
    args = parser.parse_args()
    levels = [int(n) for n in args.levels.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "command": f"python -m benchmarks.ray_overhead_cpu --out {args.out} --levels {args.levels} "
        f"--rounds {args.rounds} --max-duration {args.max_duration}",
        "commit": commit,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "serve_args": SERVE_ARGS,
        "paths": {},
    }
    for name, extra in PATHS.items():
        log_path = args.out.with_suffix(f".{name}.log")
        with ServerProcess([*SERVE_ARGS, *extra], log_path=log_path, env={"OMP_NUM_THREADS": "1"}) as server:
            results = {}
            for streams in levels:
                # one untimed round first: the first requests of a fresh server pay for lazy initialisation
                asyncio.run(
                    run_level(server.base_url, streams, sample_rate_hz=OPENAI_PCM_RATE_HZ, max_duration_s=0.5, rounds=1)
                )
                started = time.perf_counter()
                level = asyncio.run(
                    run_level(
                        server.base_url,
                        streams,
                        sample_rate_hz=OPENAI_PCM_RATE_HZ,
                        max_duration_s=args.max_duration,
                        rounds=args.rounds,
                    )
                )
                results[str(streams)] = level.summary() | {"wall_s": round(time.perf_counter() - started, 2)}
                summary = results[str(streams)]
                print(
                    f"{name}: {streams} streams, TTFA p50 {summary['ttfa_ms_p50']} p95 {summary['ttfa_ms_p95']} ms, "
                    f"errors {summary['errors']}",
                    flush=True,
                )
            report["paths"][name] = results
        log_path.unlink(missing_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
