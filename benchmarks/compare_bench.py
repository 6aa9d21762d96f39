"""Several `tilevox bench` reports of one run side by side: a markdown table and one PNG (TTFA p50/p95 and
aggregate audio seconds per second against streams, one line per report).

    python -m benchmarks.compare_bench LABEL=REPORT.json ... --out PREFIX

Writes PREFIX.md and PREFIX.png. Used to compare serving with a `tilevox build` plan against each single
fixed choice (all CUDA graphs, all megakernel) measured on the same machine in the same device call.
Imports: stdlib, matplotlib (lazily).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["main", "markdown", "plot"]

COLUMNS = ("ttfa_ms_p50", "ttfa_ms_p95", "rtf_p50", "audio_s_per_s", "stalls")


def _load(spec: str) -> tuple[str, dict]:
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise SystemExit(f"expected LABEL=REPORT.json, got {spec!r}")
    return label, json.loads(Path(path).read_text())


def markdown(reports: list[tuple[str, dict]]) -> str:
    """One row per (streams, report): TTFA p50 / p95, RTF p50, audio s/s, stalls."""
    lines = [
        "| streams | configuration | TTFA p50 / p95 ms | RTF p50 | audio s/s | stalls |",
        "|---:|---|---|---:|---:|---:|",
    ]
    levels = sorted({level["streams"] for _, report in reports for level in report["levels"]})
    for streams in levels:
        for label, report in reports:
            level = next((lv for lv in report["levels"] if lv["streams"] == streams), None)
            if level is None:
                continue
            lines.append(
                f"| {streams} | {label} | {level['ttfa_ms_p50']:.1f} / {level['ttfa_ms_p95']:.1f} | "
                f"{level['rtf_p50']:.3f} | {level['audio_s_per_s']:.2f} | {level['stalls']} |"
            )
    return "\n".join(lines) + "\n"


def plot(reports: list[tuple[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label, report in reports:
        levels = sorted(report["levels"], key=lambda lv: lv["streams"])
        streams = [lv["streams"] for lv in levels]
        (line,) = left.plot(streams, [lv["ttfa_ms_p95"] for lv in levels], marker="o", label=f"{label} p95")
        left.plot(
            streams, [lv["ttfa_ms_p50"] for lv in levels], linestyle="--", color=line.get_color(), label=f"{label} p50"
        )
        right.plot(streams, [lv["audio_s_per_s"] for lv in levels], marker="o", color=line.get_color(), label=label)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.legend(fontsize=7)
    left.set_ylabel("time to first audio (ms)")
    right.set_ylabel("audio seconds per second")
    model = reports[0][1].get("model", "")
    fig.suptitle(f"tilevox bench, {model}: " + " vs ".join(label for label, _ in reports))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="LABEL=REPORT.json (a `tilevox bench --out` file)")
    parser.add_argument("--out", required=True, type=Path, help="prefix of the .md and .png written")
    args = parser.parse_args(argv)
    reports = [_load(spec) for spec in args.reports]
    text = markdown(reports)
    args.out.with_suffix(".md").write_text(text)
    plot(reports, args.out.with_suffix(".png"))
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
