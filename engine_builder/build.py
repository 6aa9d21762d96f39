"""`tilevox build`: profile a model's regions on this machine, search the compositions, write the plan;
and `apply_plan`, which makes a model follow a plan at run time.

The build covers what the executor can run: each decoder region whole, either as the executor's CUDA graph
of the conventional path or as one megakernel launch, and each executor region that has a megakernel backend
(the Qwen3-TTS codec decode) whole, on the executor's graph as served or on that backend; with `splits`, also
the Llama decoder step, the Qwen3-TTS talker step and the NH-TTS decoder step cut at layer boundaries
(engine_builder.composition's grid), which the executor runs in pieces (executor.split). Profiling is
measured, not simulated: for every
batch bucket it runs `SpeechModel.step` of B streams with every region on each backend (an executor region on
its graph in every conventional pass) and times each region's phase (engine_builder.profile.region_times: the
models label each phase with its region's name, the codec decode included); a region's measured time is the
conventional cost of its layers and head, or the megakernel's time for the whole region (a piece of a cut region:
that time times the piece's share of the simulated tile graphs, see build_plan). The search ranks
every candidate per bucket (engine_builder.composition.search); the plan records the winner, and the report
every candidate's prediction. A candidate's predicted step time is anchored on one measured whole step per
bucket with every region conventional (`step_time_ms`, no per-region syncs; the median of `measure_rounds`
timings): its regions' times plus what
that anchor spent outside its own regions (sampling, host work between phases, and the codec where it is no
region).

`apply_plan` installs, for each region of the plan, a `BucketDispatch` (executor.dispatch) that sends a call
to the backend the plan chose for its batch bucket (for a region cut into pieces, an executor.split backend);
the executor regions a plan does not name (all of them in a format-1 plan) run on the executor's graphs.
Imports: torch, models, executor, engine_builder.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tilevox.engine_builder.composition import (
    Backend,
    Composition,
    ConventionalCosts,
    CutCosts,
    Piece,
    Ranked,
    RegionLayout,
    cuts_s,
    enumerate_compositions,
    iter_pieces,
    model_layout,
    num_cuts,
    search,
)
from tilevox.engine_builder.plan import BucketPlan, Plan, PlanError, Provenance
from tilevox.engine_builder.profile import region_times, settle, step_time_ms, this_machine
from tilevox.engine_builder.profile_cache import ProfileCache, model_signature
from tilevox.engine_builder.regions import TilingConfig, region_compiler
from tilevox.engine_builder.simulated_costs import SimulatedMegakernelCost
from tilevox.executor.dispatch import BucketDispatch
from tilevox.executor.graphs import GRAPH_BACKENDS, GraphOptions, install_graph_regions
from tilevox.executor.megakernel import BackendOptions, MegakernelUnavailable, make_backend
from tilevox.executor.split import SPLIT_BACKENDS, SplitPiece, make_split_backend
from tilevox.models.region_backends import call_batch, executor_region_names, region_module, set_region_backend

__all__ = [
    "BuildResult",
    "apply_plan",
    "build_plan",
    "fit_cut_costs",
    "fitted_cut_costs",
    "install_composition",
    "piece_prices",
    "megakernel_tiling",
    "profile_cache_for",
    "split_compositions",
    "whole_region_compositions",
]

log = logging.getLogger("tilevox.build")


def whole_region_compositions(layout: Sequence[RegionLayout], backends: Sequence[Backend]) -> list[Composition]:
    """Every composition that runs each region whole on one of `backends` (what the executor runs today); an
    executor region's conventional form is its graph, profiled in any conventional pass (_pass_backend)."""
    conventional = tuple(b for b in backends if b.is_conventional)
    longest = max(r.num_layers for r in layout)
    candidates = enumerate_compositions(layout, conventional=conventional or (Backend.GRAPH,), grid=longest)
    allowed = {r.name: {_pass_backend(r, b) for b in backends} for r in layout}
    return [c for c in candidates if all(p.backend in allowed[p.region] for p in c.pieces)]


def split_compositions(
    layout: Sequence[RegionLayout], backends: Sequence[Backend], *, max_megakernels: int = 4
) -> list[Composition]:
    """The compositions that cut a region at layer boundaries (engine_builder.composition's grid: a quarter of
    the longest region), restricted to what the executor runs in pieces (executor.split.SPLIT_BACKENDS) on the
    profiled `backends`; every other region whole."""
    conventional = tuple(b for b in backends if b.is_conventional) or (Backend.GRAPH,)
    allowed = {r.name: {_pass_backend(r, b) for b in backends} for r in layout}
    out = []
    for candidate in enumerate_compositions(layout, conventional=conventional, max_megakernels=max_megakernels):
        if not all(p.backend in allowed[p.region] for p in candidate.pieces):
            continue
        cut = {p.region for p in candidate.pieces if not _whole(p, layout)}
        if cut and cut <= set(SPLIT_BACKENDS):
            out.append(candidate)
    return out


def _whole(piece: Piece, layout: Sequence[RegionLayout]) -> bool:
    return piece.first_layer == 0 and piece.head and piece.stop_layer == _layers(layout)[piece.region]


class _SimulatedShares:
    """Conventional costs for cut candidates: a whole region as measured; a piece of it as the measured region
    times the piece's share of the region's simulated megakernel time (SimulatedMegakernelCost.share), which
    weighs each layer and the head by their bytes and FLOPs instead of spreading the region evenly over its
    layers: the head (Llasa-1B's 193,800-row lm_head: 29 % of the weights a step reads) stays with the piece
    that runs it. Measured on an H100 (2026-12-07, b3d00b8), the even spread predicted Llasa-1B's cut after
    layer 12 (megakernel, then graph with the head) 12 % fast; these shares, 0.0 % (benchmarks.reprice_build).
    Duck-types composition.ConventionalCosts for predict_step_s."""

    def __init__(self, measured: ConventionalCosts, simulated: SimulatedMegakernelCost, layout: Sequence[RegionLayout]):
        self.measured, self.simulated, self.layout = measured, simulated, layout

    def piece_s(self, piece: Piece, batch: int) -> float:
        layers = _layers(self.layout)[piece.region]
        whole = dataclasses.replace(piece, first_layer=0, stop_layer=layers, head=True)
        whole_s = self.measured.piece_s(whole, batch)
        if _whole(piece, self.layout) or not math.isfinite(whole_s):
            return whole_s
        return whole_s * self.simulated.share(piece, batch, layers)


def piece_prices(
    measured_ms: Mapping[tuple[str, str, int], float],
    layout: Sequence[RegionLayout],
    simulated: SimulatedMegakernelCost | None = None,
) -> tuple[ConventionalCosts | _SimulatedShares, Callable[[Piece, int], float]]:
    """The search's prices from measured ms per step, keyed (region, backend value, batch): conventional costs (a
    region's time spread over its layers) and the megakernel cost of a whole region; with `simulated`, a piece of
    a cut region on either backend priced by its simulated share (_SimulatedShares, SimulatedMegakernelCost.share)."""
    layers = _layers(layout)
    conventional = ConventionalCosts(
        layer_s={
            (name, Backend(kind), batch): ms * 1e-3 / layers[name]
            for (name, kind, batch), ms in measured_ms.items()
            if Backend(kind).is_conventional
        },
        head_s={
            (name, Backend(kind), batch): 0.0 for (name, kind, batch) in measured_ms if Backend(kind).is_conventional
        },
    )

    def megakernel_s(piece: Piece, batch: int) -> float:
        whole_s = measured_ms[(piece.region, Backend.MEGAKERNEL.value, batch)] * 1e-3
        if _whole(piece, layout) or not math.isfinite(whole_s):
            return whole_s
        return whole_s * simulated.share(piece, batch, layers[piece.region])

    if simulated is None:
        return conventional, megakernel_s
    return _SimulatedShares(conventional, simulated, layout), megakernel_s


def _is_cut(composition: Composition, layout: Sequence[RegionLayout]) -> bool:
    return any(not _whole(p, layout) for p in composition.pieces)


def _to_measure(
    ranked: Sequence[Ranked],
    layout: Sequence[RegionLayout],
    measure_top: int,
    conventional: Ranked,
    *,
    splits: bool,
) -> list[tuple[Ranked, str]]:
    """The candidates `--measure` runs end to end at one bucket, each with why, in this order: the `measure_top`
    best predicted, the best cut (with splits, so that a cut is always measured against its prediction), and
    the two fixed choices a user has without a plan: `conventional` (every region on the anchor's conventional
    backend), and every region whole on the megakernel where it has one (`--megakernel all`). The plan keeps the fastest
    measured, so that at every bucket it is never slower than either fixed choice measured in the same build."""
    finite = [r for r in ranked if math.isfinite(r.step_s)]
    mk_regions = {p.region for r in finite for p in r.composition.pieces if p.backend is Backend.MEGAKERNEL}

    def all_megakernel(r: Ranked) -> bool:
        on_mk = {p.region for p in r.composition.pieces if p.backend is Backend.MEGAKERNEL}
        return not _is_cut(r.composition, layout) and on_mk == mk_regions

    chosen: list[tuple[Ranked | None, str]] = [(r, f"predicted top {measure_top}") for r in finite[:measure_top]]
    if splits:
        chosen.append((next((r for r in finite if _is_cut(r.composition, layout)), None), "best cut"))
    chosen.append((conventional, "fixed: all conventional"))
    if mk_regions:
        chosen.append((next((r for r in finite if all_megakernel(r)), None), "fixed: all megakernel"))
    out: list[tuple[Ranked, list[str]]] = []
    for r, why in chosen:
        if r is None:
            continue
        seen = next((o for o in out if o[0] is r), None)
        if seen is None:
            out.append((r, [why]))
        else:
            seen[1].append(why)
    return [(r, ", ".join(why)) for r, why in out]


def _layers(layout: Sequence[RegionLayout]) -> dict[str, int]:
    return {r.name: r.num_layers for r in layout}


def _pass_backend(region: RegionLayout, backend: Backend) -> Backend:
    """What `region` runs on while `backend` is profiled: an executor region's conventional form is the
    executor's graph as served (never Inductor-compiled), whichever conventional backend is profiled."""
    return Backend.GRAPH if region.executor and backend.is_conventional else backend


def _region_backend(
    model, name: str, kind: Backend, made: dict, *, graphs: GraphOptions, megakernel: BackendOptions
) -> Callable:
    """The backend that runs region `name` on `kind` (the executor's graph backend, compiled or not, or the
    megakernel), made once per (region, kind) and kept in `made`."""
    if (name, kind) not in made:
        if kind is Backend.MEGAKERNEL:
            made[(name, kind)] = make_backend(model, name, megakernel)
        else:
            options = dataclasses.replace(graphs, compile=kind is Backend.COMPILED)
            made[(name, kind)] = GRAPH_BACKENDS[name](region_module(model, name), options)
    return made[(name, kind)]


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildResult:
    plan: Plan
    measured_ms: dict[tuple[str, str, int], float]  # (region, backend, batch) -> ms per step
    anchor_ms: dict[int, float]  # batch -> ms of a whole step on the first conventional backend (unsynced regions)
    ranked: dict[int, list[dict]]  # batch -> every candidate's prediction (and measurement), best first
    unavailable: dict[str, str]  # backend -> why it was not profiled
    anchor_times_ms: dict[int, list[float]] = dataclasses.field(default_factory=dict)  # batch -> each timed step
    # the price of a cut the search used, where it came from, and what this build's measured cuts fitted
    cut_costs: dict = dataclasses.field(default_factory=dict)


def fit_cut_costs(
    buckets: Mapping[int, Sequence[tuple[Composition, float, float]]], layout: Sequence[RegionLayout]
) -> tuple[float, list[float]] | None:
    """The price of one cut, fitted from measured cut and whole candidates: per bucket, (composition, measured
    seconds, predicted seconds without any cut price) of each measured candidate. Within a bucket the whole
    candidates' mean residual (measured - predicted) is the prediction's own bias there; each cut candidate's
    residual beyond that bias, over its number of cuts inside regions, is one sample of a cut's cost. Returns
    (the median sample, clamped at zero: a cut never saves time by itself; every sample) or None where no bucket
    measured both kinds."""
    samples: list[float] = []
    for measured in buckets.values():
        whole = [m - p for c, m, p in measured if not _is_cut(c, layout)]
        cut = [(c, m - p) for c, m, p in measured if _is_cut(c, layout) and num_cuts(c) > 0]
        if whole and cut:
            bias = sum(whole) / len(whole)
            samples += [(residual - bias) / num_cuts(c) for c, residual in cut]
    if not samples:
        return None
    return max(0.0, statistics.median(samples)), samples


def fitted_cut_costs(cut_s: float) -> CutCosts:
    """The search's cut price from a fitted cost of one cut (fit_cut_costs): that cost as the launch gap, no
    separate prefetch stall (the fit includes it), the boundary tensor's round trip as before."""
    return CutCosts(launch_gap_s=cut_s, prefetch_stall_s=0.0)


def _composition_backend(
    model, pieces: Sequence[Piece], made: dict, *, graphs: GraphOptions, megakernel: BackendOptions
) -> Callable:
    """The backend that runs one region's `pieces` (in layer order): the region's own backend when it runs
    whole, else an executor.split backend of its pieces; made once per region and pieces, kept in `made`."""
    region = pieces[0].region
    if len(pieces) == 1 and pieces[0].first_layer == 0 and pieces[0].head:
        return _region_backend(model, region, pieces[0].backend, made, graphs=graphs, megakernel=megakernel)
    key = (region, tuple((p.first_layer, p.stop_layer, p.backend) for p in pieces))
    if key not in made:
        if region not in SPLIT_BACKENDS:
            raise PlanError(
                f"region {region} is cut into pieces, which the executor runs for {', '.join(SPLIT_BACKENDS)} only"
            )
        split = [
            SplitPiece(
                p.first_layer,
                p.stop_layer,
                megakernel=p.backend is Backend.MEGAKERNEL,
                compiled=p.backend is Backend.COMPILED,
            )
            for p in pieces
        ]
        made[key] = make_split_backend(model, region, split, graphs, megakernel)
    return made[key]


def _by_region(composition: Composition) -> dict[str, list[Piece]]:
    regions: dict[str, list[Piece]] = {}
    for piece in composition.pieces:
        regions.setdefault(piece.region, []).append(piece)
    return regions


def install_composition(model, composition: Composition, megakernel: BackendOptions, made: dict) -> None:
    """Put each region of `model` on the backend `composition` gives it (a region cut at layer boundaries on
    an executor.split backend of its pieces); `made` caches backends across calls, so graphs and compiled
    megakernels are reused."""
    for region, pieces in _by_region(composition).items():
        backend = _composition_backend(model, pieces, made, graphs=GraphOptions(), megakernel=megakernel)
        set_region_backend(model, region, backend)


def _with_compiler(options: BackendOptions | None) -> BackendOptions:
    """`options` (None: the defaults) with this package's region compiler where they name none."""
    options = options or BackendOptions()
    return options if options.compiler is not None else dataclasses.replace(options, compiler=region_compiler())


def megakernel_tiling(options: BackendOptions | None) -> TilingConfig | None:
    """The tiling the megakernel backends of `options` compile with (None: a compiler that does not say)."""
    compiler = _with_compiler(options).compiler
    if not hasattr(compiler, "tiling"):
        return None
    return compiler.tiling or TilingConfig()


def build_plan(
    model,
    model_id: str,
    batches: Sequence[int],
    *,
    backends: Sequence[Backend] = (Backend.GRAPH, Backend.MEGAKERNEL),
    megakernel: BackendOptions | None = None,
    warmup: int = 4,
    steps: int = 10,
    until_audio: bool = True,
    settle_s: float = 0.0,
    commit: str = "unknown",
    progress: Callable[[str], None] | None = None,
    measure_top: int = 0,
    measure_rounds: int = 3,
    cache: ProfileCache | None = None,
    splits: bool = False,
    split_context: int = 512,
) -> BuildResult:
    """Profile `model` (loaded on its device) at each batch in `batches` with each backend, search, plan.
    With `measure_top` > 0 the best predicted candidates of each bucket also run whole steps end to end,
    with the best cut and the two fixed choices (_to_measure), in `measure_rounds` interleaved rounds (each
    candidate's time the median of its rounds' means), and the bucket takes the fastest measured one (its
    prediction error is in the report). Each bucket's anchor (below) is the median of `measure_rounds`
    timings too, back to back. With `cache`
    (see `profile_cache_for`), a measurement stored by an earlier build of the same model on the same machine
    is reused instead of run again; new ones are added (the caller saves the cache). Each measurement warms up
    `warmup` steps and, with `until_audio`, until every stream has given audio (past a block codec's first
    block), then times `steps` steps. Before the first of them, `settle_s` seconds of untimed steps
    (profile.settle).

    With `splits`, the candidates also cut the regions the executor runs in pieces (split_compositions). A
    piece of a cut region, megakernel or conventional, is priced as the region's measured time on that
    backend times the piece's share of the region's simulated tile graphs (SimulatedMegakernelCost.share at
    `split_context` keys per stream: the simulation says how the time divides among the layers and the head,
    the measurement how long it is; _SimulatedShares). With `measure_top` > 0 the best cut candidate of each
    bucket is also measured end to end (whatever its rank), so the report shows how a cut measures against
    its prediction, and the measured cut and whole candidates fit the price of one cut (fit_cut_costs). That
    price goes into `cache`; a later build of the same model on this machine searches with it instead of
    CutCosts' nominal defaults (BuildResult.cut_costs says which it used)."""
    megakernel = _with_compiler(megakernel)
    tiling = megakernel_tiling(megakernel)
    batches = sorted(set(batches))
    if not batches or batches[0] < 1:
        raise ValueError(f"batches must be positive, got {batches}")
    if measure_rounds < 1:
        raise ValueError(f"measure_rounds must be >= 1, got {measure_rounds}")
    layout = model_layout(model)
    regions = [r.name for r in layout]
    on_executor = [r.name for r in layout if r.executor]  # executor regions searched (graph or megakernel)
    # A measurement that ran a megakernel is keyed by the tiling it was compiled with as well (a cache entry
    # from before the tiling was recorded matches none), and by the executor regions it ran on the megakernel
    # (an entry from before those were searched timed them on their graphs).
    mk_key: dict = {"tiling": None if tiling is None else tiling.to_dict()}
    if on_executor:
        mk_key["executor_regions"] = on_executor

    def keyed(backend: Backend) -> dict:
        return mk_key if backend is Backend.MEGAKERNEL else {}

    measured: dict[tuple[str, str, int], float] = {}
    unavailable: dict[str, str] = {}
    profiled: list[Backend] = []
    made: dict = {}

    def region_backend(region: RegionLayout, backend: Backend) -> Callable:
        kind = _pass_backend(region, backend)
        return _region_backend(model, region.name, kind, made, graphs=GraphOptions(), megakernel=megakernel)

    # Per batch, the anchor: a whole step with every region on the first conventional backend, timed end to end
    # (one sync per step, as served). What the anchor spends beyond that composition's priced regions (sampling,
    # host work between phases, the codec where it is no region, less the overlap of host and GPU that the
    # per-region syncs remove) is added to every candidate's regions: the conventional composition is predicted
    # as its anchor, every other one as the anchor plus the difference of its priced regions. The same on every
    # candidate, so it shifts predictions, not ranks.
    # Every measurement's warm-up and window; `until_audio` (the warm-up goes on until every stream has given
    # audio: profile.SteadyStreams.warm_up) is part of the cache key only where on, so that entries measured
    # without it match builds without it.
    timed = {"warmup": warmup, "steps": steps, "until_audio": until_audio}
    timing = {"warmup": warmup, "steps": steps, **({"until_audio": True} if until_audio else {})}
    rounds_key = {"rounds": measure_rounds} if measure_rounds != 1 else {}  # whole-step timings' repeats
    anchor_ms: dict[int, float] = {}
    anchor_times_ms: dict[int, list[float]] = {}  # each timed step of the anchor, for the report
    settled = [settle_s <= 0]  # whether the untimed steps before the first timing have run

    def settle_once(batch: int) -> None:
        """Before the build's first timing, whichever it is: that timing (the anchor at batch 1 on an H100,
        fbc2f21) measured 10 % slower than the same composition timed later."""
        if not settled[0]:
            settle(model, batch, settle_s)
            settled[0] = True

    # The other executor regions (sampling, prefill) as served; the searched ones are installed per pass.
    install_graph_regions(model, [n for n in executor_region_names(model) if n not in on_executor])
    for backend in backends:
        anchors = backend.is_conventional and not any(b.is_conventional for b in profiled)
        # A backend whose every bucket is in the cache is not even installed (no megakernel compile).
        cached = (
            {
                batch: cache.get("regions", backend=backend.value, batch=batch, **timing, **keyed(backend))
                for batch in batches
            }
            if cache is not None
            else {batch: None for batch in batches}
        )
        cached_anchor = {
            batch: (
                cache.get("anchor", backend=backend.value, batch=batch, **timing, **rounds_key)
                if cache is not None and anchors
                else None
            )
            for batch in batches
        }
        installed: dict[str, Callable] = {}
        kept_on_graph: set[str] = set()  # executor regions whose megakernel backend cannot be made here
        if any(times is None for times in cached.values()) or (
            anchors and any(hit is None for hit in cached_anchor.values())
        ):
            try:
                for region in layout:
                    try:
                        installed[region.name] = region_backend(region, backend)
                    except MegakernelUnavailable as exc:
                        if not region.executor:
                            raise
                        # The decoder regions are still profiled on the megakernel; this one stays on its graph.
                        unavailable[f"{backend.value} {region.name}"] = exc.reason
                        log.warning("build: %s %s not profiled: %s", backend.value, region.name, exc.reason)
                        kept_on_graph.add(region.name)
                        installed[region.name] = region_backend(region, Backend.GRAPH)
                for name, instance in installed.items():
                    set_region_backend(model, name, instance)
            except MegakernelUnavailable as exc:
                unavailable[backend.value] = exc.reason
                log.warning("build: %s not profiled: %s", backend.value, exc.reason)
                continue
        for batch in batches:
            if progress is not None:
                progress(f"{backend.value} at {batch} streams" + (" (cached)" if cached[batch] is not None else ""))
            times = cached[batch]
            if times is None:
                settle_once(batch)
                fallbacks = {name: b.num_conventional_calls for name, b in installed.items()}
                times = region_times(model, batch, **timed)
                for name in regions:
                    if name not in times:
                        raise RuntimeError(f"region {name} did not run in a step of {batch} streams")
                    if backend is Backend.MEGAKERNEL and (
                        name in kept_on_graph or installed[name].num_conventional_calls > fallbacks[name]
                    ):
                        times[name] = math.inf  # some calls ran the conventional path (reason logged)
                if cache is not None:
                    what = {"backend": backend.value, "batch": batch, **timing}
                    cache.put("regions", times, **what, **keyed(backend))
            if anchors:
                hit = cached_anchor[batch]
                if hit is not None:
                    anchor_ms[batch] = hit["step"]
                    anchor_times_ms[batch] = []  # the cache keeps means only
                else:
                    settle_once(batch)
                    times_ms: list[float] = []
                    # the median of `measure_rounds` timings, as a measured candidate's (one timing drifts)
                    anchor_ms[batch] = statistics.median(
                        [step_time_ms(model, batch, **timed, record=times_ms) for _ in range(measure_rounds)]
                    )
                    anchor_times_ms[batch] = times_ms
                    if cache is not None:
                        what = {"backend": backend.value, "batch": batch, **timing, **rounds_key}
                        cache.put("anchor", {"step": anchor_ms[batch]}, **what)
            for region in layout:
                kind = _pass_backend(region, backend).value
                if (region.name, kind, batch) in measured:
                    continue  # an executor region's graph, timed in an earlier conventional pass
                measured[(region.name, kind, batch)] = times[region.name]
                if not math.isfinite(times[region.name]) and region.name not in kept_on_graph:
                    unavailable[f"{kind} {region.name} at {batch}"] = "calls ran the conventional path (see the log)"
        profiled.append(backend)
        for region in layout:  # decoder regions back to their conventional path, executor regions to their graph
            conventional = region_backend(region, Backend.GRAPH) if region.executor else None
            set_region_backend(model, region.name, conventional)
    if not any(b.is_conventional for b in profiled):
        raise RuntimeError("no conventional backend could be profiled")
    anchor_backend = next(b for b in profiled if b.is_conventional)
    anchor_backends = {r.name: _pass_backend(r, anchor_backend) for r in layout}

    simulated = SimulatedMegakernelCost(model, context=split_context, tiling=tiling) if splits else None
    conventional, megakernel_s = piece_prices(measured, layout, simulated)
    cuts, cut_source = CutCosts(), "default"
    cut_key = {**timing, **mk_key}
    if splits:
        hit = cache.get("cut_cost", **cut_key) if cache is not None else None
        if hit is not None:  # fitted by an earlier build of this model on this machine (fit_cut_costs)
            cuts, cut_source = fitted_cut_costs(hit["s"]), "profile cache (fitted by an earlier build)"
    fit_data: dict[int, list[tuple[Composition, float, float]]] = {}

    candidates = whole_region_compositions(layout, profiled)
    if splits:
        candidates += split_compositions(layout, profiled)
        if progress is not None:
            progress(f"simulating {len(list(iter_pieces(candidates)))} megakernel pieces")
    buckets, ranked_report = [], {}
    for batch in batches:
        ranked = search(
            layout, batch, conventional=conventional, megakernel=megakernel_s, cuts=cuts, candidates=candidates
        )
        base = next(r for r in ranked if all(p.backend is anchor_backends[p.region] for p in r.composition.pieces))
        rest_ms = anchor_ms[batch] - base.step_s * 1e3
        ranked_report[batch] = [
            {
                "label": r.composition.label(),
                # the regions as the search priced them, plus the anchor's time outside its regions
                "predicted_regions_ms": r.step_s * 1e3 if math.isfinite(r.step_s) else None,  # None: not measurable
                "predicted_step_ms": (r.step_s * 1e3 + rest_ms) if math.isfinite(r.step_s) else None,
                "predicted_cuts_ms": cuts_s(r.composition, layout, batch, cuts) * 1e3,  # the cut prices in it
                "composition": r.composition.to_list(),
            }
            for r in ranked
        ]
        if not math.isfinite(ranked[0].step_s):
            raise RuntimeError(f"no candidate could be measured at batch {batch}")
        if measure_top > 0:
            chosen = _to_measure(ranked, layout, measure_top, base, splits=splits)
            top = [r for r, _ in chosen]
            rows = {id(r): row for r, row in zip(ranked, ranked_report[batch], strict=True)}
            for r, why in chosen:
                rows[id(r)]["measured_as"] = why
            ranked = [*top, *(r for r in ranked if all(r is not t for t in top))]
            ranked_report[batch] = [rows[id(r)] for r in ranked]
            # Each candidate's measurement: from the cache, or timed in `measure_rounds` interleaved rounds (the
            # order rotated each round), its time the median of its rounds' means: two timings of one composition
            # in one build differed by up to 19 % (H100, 2026-12-08, Llasa-1B; each timing's steps within 2 %),
            # so candidates timed once each, one after another, compare the machine's drift as much as themselves.
            whats, results = [], {}
            for candidate in top:
                runs_mk = any(p.backend is Backend.MEGAKERNEL for p in candidate.composition.pieces)
                what = {"composition": candidate.composition.label(), "batch": batch, **timing}
                what.update(mk_key if runs_mk else {})
                what.update(rounds_key)
                whats.append(what)
                hit = cache.get("step", **what) if cache is not None else None
                if hit is not None:
                    results[id(candidate)] = (hit["step"], [], [])  # the cache keeps means only
            to_time = [c for c in top if id(c) not in results]
            rounds: dict[int, list[float]] = {id(c): [] for c in to_time}
            steps_of: dict[int, list[float]] = {id(c): [] for c in to_time}
            for round_index in range(measure_rounds if to_time else 0):
                shift = round_index % len(to_time)
                for candidate in to_time[shift:] + to_time[:shift]:
                    if progress is not None:
                        progress(
                            f"measuring {candidate.composition.label()} at {batch} streams"
                            + (f" (round {round_index + 1} of {measure_rounds})" if measure_rounds > 1 else "")
                        )
                    install_composition(model, candidate.composition, megakernel, made)
                    settle_once(batch)
                    rounds[id(candidate)].append(step_time_ms(model, batch, **timed, record=steps_of[id(candidate)]))
            for candidate, what in zip(top, whats, strict=True):
                if id(candidate) in rounds:
                    results[id(candidate)] = (
                        statistics.median(rounds[id(candidate)]),
                        steps_of[id(candidate)],
                        rounds[id(candidate)],
                    )
                    if cache is not None:
                        cache.put("step", {"step": results[id(candidate)][0]}, **what)
            measured_steps = []
            for row, candidate in zip(ranked_report[batch], top):
                step_ms, times_ms, round_ms = results[id(candidate)]
                row["measured_step_ms"] = step_ms
                row["measured_step_times_ms"] = times_ms
                row["measured_round_ms"] = round_ms
                row["prediction_error"] = row["predicted_step_ms"] / step_ms - 1.0
                measured_steps.append(step_ms)
                uncut_ms = row["predicted_step_ms"] - row["predicted_cuts_ms"]
                fit_data.setdefault(batch, []).append((candidate.composition, step_ms * 1e-3, uncut_ms * 1e-3))
            fastest = min(range(len(top)), key=measured_steps.__getitem__)
            ranked = [top[fastest], *(r for r in ranked if r is not top[fastest])]
            ranked_report[batch].insert(0, ranked_report[batch].pop(fastest))
        buckets.append(BucketPlan.best_of(batch, ranked))
    cut_costs: dict = {"used_cut_s": cuts.launch_gap_s, "used_prefetch_stall_s": cuts.prefetch_stall_s}
    cut_costs["source"] = cut_source
    fit = fit_cut_costs(fit_data, layout) if splits else None
    if fit is not None:
        cut_costs.update(fitted_cut_s=fit[0], samples_s=fit[1])
        if cache is not None:  # a later build of this model here searches with it (measured or not)
            cache.put("cut_cost", {"s": fit[0]}, **cut_key)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    provenance = this_machine(model.device, commit=commit, profile_date=now)
    recorded = tiling if Backend.MEGAKERNEL in profiled else None
    plan = Plan(
        model=model_id,
        provenance=provenance,
        layout=layout,
        buckets=tuple(buckets),
        tiling=None if recorded is None else recorded.to_dict(),
    )
    plan.validate()
    return BuildResult(
        plan=plan,
        measured_ms=measured,
        anchor_ms=anchor_ms,
        anchor_times_ms=anchor_times_ms,
        ranked=ranked_report,
        unavailable=unavailable,
        cut_costs=cut_costs,
    )


def profile_cache_for(model, model_id: str, path: Path | None) -> ProfileCache:
    """The profile cache at `path` (None: in memory only) for `model` on this machine: entries match only the
    same GPU, driver, kernel library, torch version, model id, dtype and parameter shapes (build_plan adds the
    megakernel tiling to the key of every measurement that ran a megakernel)."""
    machine = this_machine(model.device, commit="", profile_date="")
    dtype = next(p.dtype for m in model.torch_modules() for p in m.parameters())
    context = {
        "gpu": machine.gpu,
        "driver": machine.driver,
        "library_hash": machine.library_hash,
        "torch": torch.__version__,
        "model": model_id,
        "dtype": str(dtype),
        "signature": model_signature(model.torch_modules()),
    }
    return ProfileCache(path, context)


def apply_plan(
    model,
    plan: Plan,
    *,
    graphs: GraphOptions | None = None,
    megakernel: BackendOptions | None = None,
) -> dict[str, BucketDispatch]:
    """Make `model` follow `plan`: per region of the plan, a dispatcher over the backends its buckets chose
    (a call above the largest bucket runs that bucket's choice), and the executor's graphs for the other
    executor regions (those an older plan does not name included). Megakernel pieces are compiled with the
    plan's tiling where it records one (its predictions were measured with it), else with `megakernel`'s
    compiler. A region the plan cuts at layer boundaries runs on an executor.split backend of its pieces.
    Raises PlanError for a plan of another layout, or one that cuts a region the executor does not run in
    pieces."""
    graphs, megakernel = graphs or GraphOptions(), megakernel or BackendOptions()
    if plan.tiling is not None:
        megakernel = dataclasses.replace(megakernel, compiler=region_compiler(TilingConfig.from_dict(plan.tiling)))
    megakernel = _with_compiler(megakernel)
    _check_layout(plan, model_layout(model))
    planned = {r.name for r in plan.layout}
    install_graph_regions(model, [n for n in executor_region_names(model) if n not in planned], graphs)
    made: dict[tuple, Callable] = {}
    dispatchers = {}
    for region in plan.layout:
        choices = []
        for bucket in plan.buckets:
            pieces = _by_region(bucket.composition)[region.name]
            backend = _composition_backend(model, pieces, made, graphs=graphs, megakernel=megakernel)
            label = pieces[0].backend.value if len(pieces) == 1 else Composition(tuple(pieces)).label()
            choices.append((bucket.batch, label, backend))
        dispatcher = BucketDispatch(region.name, lambda *a, _n=region.name, **k: call_batch(_n, *a, **k), choices)
        set_region_backend(model, region.name, dispatcher)
        dispatchers[region.name] = dispatcher
    return dispatchers


def _check_layout(plan: Plan, layout: Sequence[RegionLayout]) -> None:
    """PlanError unless the plan's regions are the model's, in its order: every decoder region, and any of its
    executor regions (a plan built before they were searched names none; they then stay on their graphs)."""
    names = {r.name for r in plan.layout}
    expected = tuple(r for r in layout if r.name in names or not r.executor)
    if tuple(plan.layout) != expected:
        raise PlanError(f"the plan's regions {list(plan.layout)} do not match this model's {list(expected)}")


def provenance_here(device: torch.device) -> Provenance:
    """This machine's provenance, for checking a plan at load time (commit and date are not compared)."""
    return this_machine(device, commit="", profile_date="")
