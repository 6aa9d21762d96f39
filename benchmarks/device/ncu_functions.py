"""Per-function totals of Nsight Compute's PC sampling for one megakernel launch (issue 13: where a small
instruction's time goes). Reads mk_ncu.sh's NAME_sass.csv.gz (`ncu --page source --csv --print-source sass`: one
row per SASS instruction, with its address, executed instructions and warp-stall samples by reason) and an
nvdisasm listing of the same cubin (`nvdisasm -c`), whose labels give each function's start address: the
interpreter loop, each opcode body (`op_*`, `__noinline__`), their helpers. Prints, per function, its share of all
samples, its executed instructions and its leading stall reasons; the spin-wait of wait_deps falls in the loop or
in the opcode that calls it.

    python3 benchmarks/device/ncu_functions.py pred_sass.csv.gz megakernel.sass [--json out.json] [--function op_qkv]
"""

from __future__ import annotations

import argparse
import bisect
import csv
import gzip
import io
import json
import re
from collections import defaultdict
from pathlib import Path

_LABEL = re.compile(r"^(?:\$[^\s$]*\$)?(\$?[_A-Za-z][\w$.]*):\s*$")
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")
_OPCODE = re.compile(r"^\s*(?:\{\s*)?(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def function_starts(listing: str) -> list[tuple[int, str]]:
    """(start address, short name) of every function in an `nvdisasm -c` listing, sorted by address. Lines that
    begin with a dot (sections, directives, the `.L_x_` branch labels) are no function's."""
    starts, pending = [], None
    for line in listing.splitlines():
        if line.lstrip().startswith("."):
            continue
        label = _LABEL.match(line.strip())
        if label:
            pending = label.group(1)
            continue
        addr = _ADDR.search(line)
        if addr and pending:
            starts.append((int(addr.group(1), 16), short_name(pending)))
            pending = None
    return sorted(starts)


def listing_opcodes(listing: str) -> dict[int, str]:
    """Each instruction's opcode (without its predicate) by its address in an `nvdisasm -c` listing."""
    out = {}
    for line in listing.splitlines():
        addr = _ADDR.search(line)
        if addr:
            op = _OPCODE.match(line[addr.end() :])
            if op:
                out[int(addr.group(1), 16)] = op.group(1)
    return out


def short_name(mangled: str) -> str:
    """The function's own name out of an Itanium-mangled one in the megakernel's anonymous namespace (its length-
    prefixed name after the translation unit's `_cu_<hash>`, with integer template arguments), else the label."""
    tail = re.split(r"_cu_[0-9a-f]{8}", mangled)[-1]
    length = re.match(r"\d+", tail)
    if length is None:
        return mangled.lstrip("$")
    start = length.end()
    name, rest = tail[start : start + int(length.group(0))], tail[start + int(length.group(0)) :]
    template = re.match(r"I((?:Lin?\d+E)+)E", rest)
    if template is None:
        return name
    values = [v.replace("n", "-") for v in re.findall(r"Li(n?\d+)E", template.group(1))]
    return f"{name}<{','.join(values)}>"


def read_source_csv(path: Path) -> list[dict[str, str]]:
    text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith('"Address"') or line.startswith("Address"))
    return list(csv.DictReader(io.StringIO("\n".join(lines[header:]))))


def _number(value: str | None) -> float:
    """A metric cell: ncu leaves a cell empty where an instruction has no value; anything else must parse."""
    return float(value.replace(",", "")) if value else 0.0


def summarize(rows: list[dict[str, str]], starts: list[tuple[int, str]], opcodes: dict[int, str] | None = None) -> dict:
    """Samples, executed instructions and stall reasons summed per function. The export's addresses are where the
    kernel was loaded, the listing's are offsets in the kernel's section: every row is placed at its address less
    the export's lowest (the kernel's entry). With `opcodes` (listing_opcodes), the first instruction of every
    function must have the same opcode in the export, or the listing is of another build. ValueError when the
    export has no PC-sampling column (a report collected without the SourceCounters section): its totals would
    all be zero; or when the opcodes disagree."""
    columns = list(rows[0]) if rows else []
    samples = next((c for c in columns if "Sampling (All" in c), None)
    if samples is None:
        raise ValueError(f"no 'Warp Stall Sampling (All Samples)' column among {columns}")
    executed = next((c for c in columns if c.startswith("Instructions Executed")), None)
    reasons = [c for c in columns if c.startswith("stall_") or c.startswith("smsp__pcsamp")]
    addresses = [a for a, _ in starts]
    base = min((int(row["Address"], 16) for row in rows), default=0)
    if opcodes is not None:
        source = {int(row["Address"], 16) - base: row["Source"] for row in rows}
        for start, name in starts:
            listed, op = opcodes.get(start), _OPCODE.match(source.get(start, ""))
            if listed is None or op is None or op.group(1) != listed:
                found = op.group(1) if op else None
                raise ValueError(f"{name} at +{start:#x}: the listing has {listed}, the export {found}")
    per: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        i = bisect.bisect_right(addresses, int(row["Address"], 16) - base) - 1
        name = starts[i][1] if i >= 0 else "?"
        per[name]["samples"] += _number(row[samples])
        if executed:
            per[name]["executed"] += _number(row[executed])
        for reason in reasons:
            per[name][reason] += _number(row[reason])
    total = sum(v["samples"] for v in per.values()) or 1.0
    out = []
    for name, v in sorted(per.items(), key=lambda kv: -kv[1]["samples"]):
        top = sorted(((r, v[r]) for r in reasons if v[r] > 0), key=lambda t: -t[1])[:6]
        out.append(
            {
                "function": name,
                "samples": v["samples"],
                "share_pct": 100 * v["samples"] / total,
                "executed": v["executed"],
                "stalls": {r: x for r, x in top},
            }
        )
    return {"columns": columns, "samples_column": samples, "functions": out}


def hot_spots(rows: list[dict[str, str]], starts: list[tuple[int, str]], function: str, span: int = 256) -> list[dict]:
    """Inside one function: its samples per `span` bytes of code (16 instructions by default), hottest first, each
    with its offset in the function, executed instructions, leading stall reasons and the span's instructions that
    ran. ValueError for a function the listing does not name, or an export without PC samples."""
    named = [i for i, (_, name) in enumerate(starts) if name == function]
    if not named:
        raise ValueError(f"no function {function!r} in the listing; it names {sorted({n for _, n in starts})}")
    lo = starts[named[0]][0]
    hi = starts[named[0] + 1][0] if named[0] + 1 < len(starts) else None
    columns = list(rows[0]) if rows else []
    samples = next((c for c in columns if "Sampling (All" in c), None)
    if samples is None:
        raise ValueError(f"no 'Warp Stall Sampling (All Samples)' column among {columns}")
    executed = next((c for c in columns if c.startswith("Instructions Executed")), None)
    reasons = [c for c in columns if c.startswith("stall_") and "Not Issued" not in c]
    base = min((int(row["Address"], 16) for row in rows), default=0)
    spans: dict[int, dict] = {}
    for row in rows:
        offset = int(row["Address"], 16) - base
        if offset < lo or (hi is not None and offset >= hi):
            continue
        at = (offset - lo) // span * span
        entry = spans.setdefault(
            at, {"offset": at, "samples": 0.0, "executed": 0.0, "stalls": defaultdict(float), "code": []}
        )
        entry["samples"] += _number(row[samples])
        ran = _number(row[executed]) if executed else 0.0
        entry["executed"] += ran
        for reason in reasons:
            entry["stalls"][reason] += _number(row[reason])
        if ran > 0:
            entry["code"].append(row["Source"].strip())
    out = sorted(spans.values(), key=lambda e: -e["samples"])
    for entry in out:
        entry["stalls"] = dict(sorted(((r, x) for r, x in entry["stalls"].items() if x > 0), key=lambda t: -t[1])[:3])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sass_csv", type=Path)
    parser.add_argument("listing", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--function", help="also list this function's hottest code spans (e.g. op_qkv)")
    parser.add_argument("--top", type=int, default=12, help="how many spans --function lists")
    args = parser.parse_args()
    listing = gzip.open(args.listing, "rt").read() if args.listing.suffix == ".gz" else args.listing.read_text()
    rows, starts = read_source_csv(args.sass_csv), function_starts(listing)
    result = summarize(rows, starts, listing_opcodes(listing))
    print(f"{'function':<44}{'share %':>9}{'samples':>10}{'executed':>12}  leading stall reasons (samples)")
    for f in result["functions"]:
        if f["samples"] <= 0:
            continue
        stalls = ", ".join(f"{r.removeprefix('stall_')} {x:.0f}" for r, x in f["stalls"].items())
        print(f"{f['function'][:43]:<44}{f['share_pct']:>9.1f}{f['samples']:>10.0f}{f['executed']:>12.0f}  {stalls}")
    if args.function:
        spots = hot_spots(rows, starts, args.function)
        result["hot_spots"] = {"function": args.function, "spans": spots}
        print(f"\n{args.function}: hottest code spans (offset in the function, samples, executed, stalls, first ran)")
        for e in spots[: args.top]:
            stalls = ", ".join(f"{r.removeprefix('stall_')} {x:.0f}" for r, x in e["stalls"].items())
            first = e["code"][0] if e["code"] else "-"
            print(f"  +{e['offset']:#07x} {e['samples']:>8.0f} {e['executed']:>10.0f}  {stalls:<44} {first[:50]}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
