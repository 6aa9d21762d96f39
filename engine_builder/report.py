"""The build report's figures: predicted against measured step time of every candidate that ran end to end,
per batch bucket (a point on the diagonal is a perfect prediction; the chosen one is ringed), and the
simulated timeline of a chosen megakernel piece: each SM's queue of instructions over time, coloured by
opcode, so the gaps (counter waits) and the longest queue are visible. Imports: matplotlib (the `bench`
extra), lazily.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["plot_predicted_vs_measured", "plot_sm_timeline"]


def plot_predicted_vs_measured(candidates: Mapping[str, Sequence[Mapping]], path: Path) -> int:
    """`candidates`: batch -> ranked rows (best first) as the build report writes them; rows without a
    `measured_step_ms` are left out. Writes a PNG and returns how many points it drew (0: nothing measured,
    no file)."""
    points = [
        (batch, row["predicted_step_ms"], row["measured_step_ms"], index == 0)
        for batch, rows in candidates.items()
        for index, row in enumerate(rows)
        if row.get("measured_step_ms") is not None and row.get("predicted_step_ms") is not None
    ]
    if not points:
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    batches = sorted({int(b) for b, *_ in points})
    for batch in batches:
        mine = [(p, m, chosen) for b, p, m, chosen in points if int(b) == batch]
        ax.scatter([p for p, _, _ in mine], [m for _, m, _ in mine], label=f"batch {batch}", s=30)
        for p, m, chosen in mine:
            if chosen:
                ax.scatter([p], [m], s=140, facecolors="none", edgecolors="black")
    top = max(max(p, m) for _, p, m, _ in points) * 1.1
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("predicted step (ms)")
    ax.set_ylabel("measured step (ms)")
    ax.set_title("tilevox build: candidates run end to end (ringed: chosen)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return len(points)


def plot_sm_timeline(program, schedule, path: Path, *, title: str) -> int:
    """One horizontal bar per instruction on its SM's row, from its simulated start to its finish
    (engine_builder.regions.schedule.simulate). Returns the number of SM rows drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    used = sorted({sm for sm in schedule.sm if sm >= 0})
    row_of = {sm: row for row, sm in enumerate(used)}
    opcodes = sorted({inst.opcode.name for inst in program.instructions})
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(opcodes)}
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.06 * len(used) + 1.5)))
    # One collection of rectangles per opcode: an artist per instruction (thousands) took 20-25 s a figure.
    boxes: dict[str, list] = {name: [] for name in opcodes}
    for index, inst in enumerate(program.instructions):
        start, finish = schedule.start_s[index] * 1e6, schedule.finish_s[index] * 1e6
        row = row_of[schedule.sm[index]]
        boxes[inst.opcode.name].append(
            ((start, row - 0.4), (start, row + 0.4), (finish, row + 0.4), (finish, row - 0.4))
        )
    for name, verts in boxes.items():
        ax.add_collection(PolyCollection(verts, facecolors=[colours[name]], edgecolors="none"))
    ax.set_xlim(0, max(schedule.makespan_s * 1e6, 1e-3) * 1.01)
    ax.set_ylim(-1, max(len(used), 1))
    from matplotlib.patches import Patch

    handles = [Patch(color=colours[name], label=name) for name in opcodes]
    ax.set_xlabel(f"simulated time (us); makespan {schedule.makespan_s * 1e6:.1f} us")
    ax.set_ylabel(f"SM queue ({len(used)} used)")
    ax.set_yticks([])
    ax.set_title(title)
    ax.legend(handles=handles, loc="upper left", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(used)
