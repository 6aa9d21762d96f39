"""Where to cut: the candidate compositions of a model's decode regions, their predicted step time, the
search that picks one per batch bucket, and the model's category.

A model's frame is a sequence of regions (`RegionLayout`, in the order the model declares them: Qwen3-TTS
`talker_step` and `code_predictor_loop`; Llasa `decoder_step`), each a run of layers (a region that cannot be cut, like the
predictor loop, is one unit) followed by its head. A `Composition` cuts every region into consecutive
`Piece`s, each run conventionally (captured CUDA graph of eager ops, or Inductor-compiled) or as one
megakernel launch. Legal compositions: all conventional; the region as one megakernel; two to
`max_megakernels` megakernels split at layer boundaries on a grid; and those with conventional pieces
between them (`enumerate_compositions`). After the decoder regions come the executor regions that have a
megakernel backend (Qwen3-TTS `codec_decode`; `RegionLayout.executor`): one uncuttable unit each, on the
executor's CUDA graph as served or as the megakernel backend, never Inductor-compiled, and no cut is priced
into or out of one (its measured time holds its own launches, and host work separates it from its
neighbours).

Prediction (`predict_step_s`) adds measured conventional times per layer and per head (a Vidur-like
table, `ConventionalCosts`), each megakernel piece's time from a `MegakernelCost` (in the builder: the
simulated tile graph of the compiled piece, engine_builder.regions.schedule.simulate), and the price of
every cut between two pieces (`CutCosts`: the launch gap, the boundary tensor's round trip through memory
at the batch's row count, the consumer's weight-prefetch stall). The objective per batch bucket is the
predicted time to first audio, prefill + one frame + its codec decode (`codec_s`, or inside the frame where
the codec decode is a region of the layout): the composition changes only the frame, so the best frame is
the best TTFA, and throughput (streams / frame time) breaks ties the same way; `search` ranks every
candidate and keeps them all (their errors are reported, not only the winner's). `classify` names how the
best composition moves with the batch (stable, receding, advancing, averse). `model_layout` reads a model's
regions. Imports: stdlib (model_layout: models, executor.megakernel, engine_builder.regions, lazily).
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Backend",
    "Category",
    "Classification",
    "Composition",
    "ConventionalCosts",
    "CutCosts",
    "MegakernelCost",
    "Piece",
    "Ranked",
    "RegionLayout",
    "classify",
    "enumerate_compositions",
    "cuts_s",
    "iter_pieces",
    "megakernel_layer_share",
    "model_layout",
    "num_cuts",
    "predict_step_s",
    "search",
]


class Backend(enum.Enum):
    GRAPH = "graph"  # the conventional path captured in a CUDA graph (the executor's default)
    COMPILED = "compiled"  # the conventional path compiled by Inductor, then captured
    MEGAKERNEL = "megakernel"  # one persistent-kernel launch

    @property
    def is_conventional(self) -> bool:
        return self is not Backend.MEGAKERNEL


@dataclass(frozen=True, slots=True, kw_only=True)
class RegionLayout:
    """One region of a model's frame: `num_layers` layers then a head (norm + logits + sampling).
    `cuttable`: whether a megakernel may cover only some of its layers (the predictor loop may not).
    `boundary_bytes_per_row`: the hidden state crossing a cut, per stream (hidden size x element size).
    `executor`: an executor region (models.region_backends.executor_region_names) with a megakernel backend:
    one unit (a layer, no head cost), on Backend.GRAPH (the executor's graph as served) or Backend.MEGAKERNEL."""

    name: str
    num_layers: int
    cuttable: bool = True
    boundary_bytes_per_row: int = 0
    executor: bool = False

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"region {self.name}: num_layers must be >= 1, got {self.num_layers}")
        if self.boundary_bytes_per_row < 0:
            raise ValueError(f"region {self.name}: boundary_bytes_per_row must be >= 0")
        if self.executor and self.cuttable:
            raise ValueError(f"region {self.name}: an executor region cannot be cut (cuttable=False)")

    def backends(self, conventional: Sequence[Backend]) -> tuple[Backend, ...]:
        """The backends this region may run whole on, given the conventional forms profiled: an executor
        region's conventional form is always the executor's graph (it is never Inductor-compiled)."""
        return (Backend.GRAPH, Backend.MEGAKERNEL) if self.executor else (*conventional, Backend.MEGAKERNEL)


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """Layers [first_layer, stop_layer) of `region`, with its head when `head` (the last piece)."""

    region: str
    first_layer: int
    stop_layer: int
    head: bool
    backend: Backend

    def __post_init__(self) -> None:
        if not 0 <= self.first_layer < self.stop_layer:
            raise ValueError(
                f"piece layers must satisfy 0 <= first < stop, got [{self.first_layer}, {self.stop_layer})"
            )

    @property
    def num_layers(self) -> int:
        return self.stop_layer - self.first_layer

    def to_dict(self) -> dict:
        return {
            "region": self.region,
            "first_layer": self.first_layer,
            "stop_layer": self.stop_layer,
            "head": self.head,
            "backend": self.backend.value,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> Piece:
        return cls(
            region=str(data["region"]),
            first_layer=int(data["first_layer"]),
            stop_layer=int(data["stop_layer"]),
            head=bool(data["head"]),
            backend=Backend(data["backend"]),
        )


@dataclass(frozen=True, slots=True)
class Composition:
    """Pieces in frame order: every region's layers covered once, in order, the head on its last piece."""

    pieces: tuple[Piece, ...]

    def validate(self, layout: Sequence[RegionLayout]) -> None:
        """Raise ValueError unless the pieces cover each region of `layout` exactly, in order."""
        by_region: dict[str, list[Piece]] = {}
        order: list[str] = []
        for piece in self.pieces:
            if piece.region not in by_region:
                order.append(piece.region)
            elif order[-1] != piece.region:
                raise ValueError(f"region {piece.region}'s pieces are not consecutive")
            by_region.setdefault(piece.region, []).append(piece)
        if order != [r.name for r in layout]:
            raise ValueError(f"regions {order} do not match the model's {[r.name for r in layout]}")
        for region in layout:
            pieces = by_region[region.name]
            edges = [p.first_layer for p in pieces] + [pieces[-1].stop_layer]
            if (
                edges[0] != 0
                or edges[-1] != region.num_layers
                or any(p.stop_layer != q.first_layer for p, q in itertools.pairwise(pieces))
            ):
                raise ValueError(f"region {region.name}: pieces {edges} do not cover layers [0, {region.num_layers})")
            if [p.head for p in pieces] != [False] * (len(pieces) - 1) + [True]:
                raise ValueError(f"region {region.name}: the head belongs to its last piece only")
            if not region.cuttable and len(pieces) != 1:
                raise ValueError(f"region {region.name} cannot be cut")
            if region.executor and pieces[0].backend not in region.backends(()):
                raise ValueError(
                    f"executor region {region.name} runs on graph or megakernel, not {pieces[0].backend.value}"
                )

    @property
    def num_megakernels(self) -> int:
        return sum(p.backend is Backend.MEGAKERNEL for p in self.pieces)

    def label(self) -> str:
        """Short human-readable form: region[first-stop]=backend pieces, e.g. `talker_step[0-14]=mk`."""
        short = {Backend.GRAPH: "graph", Backend.COMPILED: "compiled", Backend.MEGAKERNEL: "mk"}
        return " ".join(
            f"{p.region}[{p.first_layer}-{p.stop_layer}{'+head' if p.head else ''}]={short[p.backend]}"
            for p in self.pieces
        )

    def to_list(self) -> list[dict]:
        return [p.to_dict() for p in self.pieces]

    @classmethod
    def from_list(cls, data: Sequence[Mapping]) -> Composition:
        return cls(tuple(Piece.from_dict(d) for d in data))


def _region_splits(
    region: RegionLayout, conventional: Sequence[Backend], max_megakernels: int, grid: int
) -> list[tuple[Piece, ...]]:
    """Every legal way to run one region: conventional whole (each form), one megakernel whole, and for a
    cuttable region 2..max_megakernels megakernels and mixed runs, cut on a grid of `grid` layers."""
    n = region.num_layers
    options: list[tuple[Piece, ...]] = []
    for backend in region.backends(conventional):
        options.append((Piece(region=region.name, first_layer=0, stop_layer=n, head=True, backend=backend),))
    if not region.cuttable or n < 2:
        return options
    cut_points = [c for c in range(grid, n, grid)]
    seen = {tuple((p.first_layer, p.stop_layer, p.backend) for p in o) for o in options}
    for num_cuts in range(1, len(cut_points) + 1):
        for cuts in itertools.combinations(cut_points, num_cuts):
            edges = (0, *cuts, n)
            spans = list(itertools.pairwise(edges))
            # each span is a megakernel or one conventional form; merge neighbouring conventional spans
            for kinds in itertools.product((*conventional, Backend.MEGAKERNEL), repeat=len(spans)):
                if sum(k is Backend.MEGAKERNEL for k in kinds) > max_megakernels:
                    continue
                if any(a.is_conventional and a is b for a, b in itertools.pairwise(kinds)):
                    continue  # two same-form conventional spans side by side: that is one span, not a cut
                pieces = tuple(
                    Piece(region=region.name, first_layer=a, stop_layer=b, head=b == n, backend=k)
                    for (a, b), k in zip(spans, kinds)
                )
                key = tuple((p.first_layer, p.stop_layer, p.backend) for p in pieces)
                if key not in seen:
                    seen.add(key)
                    options.append(pieces)
    return options


def enumerate_compositions(
    layout: Sequence[RegionLayout],
    *,
    conventional: Sequence[Backend] = (Backend.GRAPH,),
    max_megakernels: int = 4,
    grid: int | None = None,
) -> list[Composition]:
    """All legal compositions of the model's regions (the product of each region's options), with at most
    `max_megakernels` megakernels in the whole frame. `grid`: layers between candidate cuts (default: a
    quarter of the longest region, so a 28-layer talker is cut at 7, 14, 21)."""
    if max_megakernels < 1:
        raise ValueError(f"max_megakernels must be >= 1, got {max_megakernels}")
    if not conventional or any(not b.is_conventional for b in conventional):
        raise ValueError("conventional must list conventional backends (graph, compiled)")
    longest = max(r.num_layers for r in layout)
    grid = grid or max(1, longest // 4)
    per_region = [_region_splits(r, conventional, max_megakernels, grid) for r in layout]
    out = []
    for combo in itertools.product(*per_region):
        pieces = tuple(p for region_pieces in combo for p in region_pieces)
        if sum(p.backend is Backend.MEGAKERNEL for p in pieces) <= max_megakernels:
            out.append(Composition(pieces))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ConventionalCosts:
    """Measured conventional times (seconds), keyed (region, backend, batch): one layer, and the head
    (final norm, logits, sampling). Batches between measured ones are interpolated linearly; outside the
    measured range is an error (never extrapolated)."""

    layer_s: Mapping[tuple[str, Backend, int], float]
    head_s: Mapping[tuple[str, Backend, int], float]

    def _lookup(self, table: Mapping[tuple[str, Backend, int], float], region: str, backend: Backend, batch: int):
        batches = sorted(b for (r, k, b) in table if r == region and k is backend)
        if not batches:
            raise KeyError(f"no {backend.value} times measured for region {region}")
        if batch in batches:
            return table[(region, backend, batch)]
        lower = [b for b in batches if b < batch]
        upper = [b for b in batches if b > batch]
        if not lower or not upper:
            raise KeyError(f"batch {batch} is outside the measured batches {batches} of {region} ({backend.value})")
        lo, hi = lower[-1], upper[0]
        t_lo, t_hi = table[(region, backend, lo)], table[(region, backend, hi)]
        return t_lo + (t_hi - t_lo) * (batch - lo) / (hi - lo)

    def piece_s(self, piece: Piece, batch: int) -> float:
        time = piece.num_layers * self._lookup(self.layer_s, piece.region, piece.backend, batch)
        if piece.head:
            time += self._lookup(self.head_s, piece.region, piece.backend, batch)
        return time


# (piece, batch) -> seconds for one megakernel launch of that piece (the builder simulates its tile graph)
MegakernelCost = Callable[[Piece, int], float]


@dataclass(frozen=True, slots=True, kw_only=True)
class CutCosts:
    """The price of one cut between two pieces (and of entering or leaving a megakernel from the graph):
    a launch gap, the boundary tensor written and read back (`boundary_bytes_per_row` x batch x 2 at
    `memory_bytes_per_s`), and the consumer's weight-prefetch stall when the consumer is a megakernel.
    Fitted from measured split-vs-fused pairs in the builder; the defaults are the H200 launch gap
    (about 1.3 us under graphs, ../shared/docs/engine-builder.md) and a nominal prefetch stall."""

    launch_gap_s: float = 1.3e-6
    memory_bytes_per_s: float = 4.8e12
    prefetch_stall_s: float = 2.0e-6

    def cut_s(self, producer: Piece, consumer: Piece, boundary_bytes_per_row: int, batch: int) -> float:
        if producer.backend.is_conventional and consumer.backend.is_conventional:
            if producer.backend is consumer.backend and producer.region == consumer.region:
                return 0.0  # one conventional span, not a cut
        time = self.launch_gap_s + 2 * boundary_bytes_per_row * batch / self.memory_bytes_per_s
        if consumer.backend is Backend.MEGAKERNEL:
            time += self.prefetch_stall_s
        return time


def predict_step_s(
    composition: Composition,
    layout: Sequence[RegionLayout],
    batch: int,
    *,
    conventional: ConventionalCosts,
    megakernel: MegakernelCost,
    cuts: CutCosts = CutCosts(),
) -> float:
    """Predicted time of one frame (or step) of `batch` streams under `composition` (no cut priced into or
    out of an executor region)."""
    total = 0.0
    for piece in composition.pieces:
        total += megakernel(piece, batch) if piece.backend is Backend.MEGAKERNEL else conventional.piece_s(piece, batch)
    return total + cuts_s(composition, layout, batch, cuts)


def cuts_s(composition: Composition, layout: Sequence[RegionLayout], batch: int, cuts: CutCosts = CutCosts()) -> float:
    """The part of predict_step_s that prices the composition's cuts (none into or out of an executor region)."""
    boundary = {r.name: r.boundary_bytes_per_row for r in layout}
    executor = {r.name for r in layout if r.executor}
    return sum(
        cuts.cut_s(producer, consumer, boundary[consumer.region], batch)
        for producer, consumer in itertools.pairwise(composition.pieces)
        if producer.region not in executor and consumer.region not in executor
    )


def num_cuts(composition: Composition) -> int:
    """Cuts inside a region: neighbouring pieces of one region (the boundaries between regions are not cuts)."""
    return sum(p.region == q.region for p, q in itertools.pairwise(composition.pieces))


@dataclass(frozen=True, slots=True, kw_only=True)
class Ranked:
    composition: Composition
    step_s: float  # predicted frame time
    ttfa_s: float  # predicted time to first audio: prefill + frame + codec of the first frame
    streams_per_s: float  # throughput: frames per second x batch


def search(
    layout: Sequence[RegionLayout],
    batch: int,
    *,
    conventional: ConventionalCosts,
    megakernel: MegakernelCost,
    cuts: CutCosts = CutCosts(),
    candidates: Sequence[Composition] | None = None,
    prefill_s: float = 0.0,
    codec_s: float = 0.0,
) -> list[Ranked]:
    """Every candidate (default: enumerate_compositions(layout)) ranked best first by predicted TTFA,
    then throughput, then fewer megakernels (a simpler plan wins a tie)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    candidates = enumerate_compositions(layout) if candidates is None else candidates
    ranked = []
    for composition in candidates:
        composition.validate(layout)
        step = predict_step_s(composition, layout, batch, conventional=conventional, megakernel=megakernel, cuts=cuts)
        ranked.append(
            Ranked(composition=composition, step_s=step, ttfa_s=prefill_s + step + codec_s, streams_per_s=batch / step)
        )
    ranked.sort(key=lambda r: (r.ttfa_s, -r.streams_per_s, r.composition.num_megakernels))
    return ranked


def megakernel_layer_share(composition: Composition) -> float:
    """Fraction of the frame's layers that run inside a megakernel."""
    layers = sum(p.num_layers for p in composition.pieces)
    return sum(p.num_layers for p in composition.pieces if p.backend is Backend.MEGAKERNEL) / layers


class Category(enum.Enum):
    STABLE = "megakernel-stable"  # the same megakernel composition is best at every batch
    RECEDING = "megakernel-receding"  # megakernels cover less of the frame as the batch grows
    ADVANCING = "megakernel-advancing"  # megakernels cover more of the frame as the batch grows
    AVERSE = "megakernel-averse"  # all conventional at every batch


@dataclass(frozen=True, slots=True)
class Classification:
    category: Category
    shares: dict[int, float] = field(default_factory=dict)  # batch -> megakernel layer share of the best
    reason: str = ""


def classify(best: Mapping[int, Composition]) -> Classification:
    """From the best composition per batch (at least one batch): the category and why. The trend is the
    sign of the least-squares slope of the megakernel layer share against log2(batch)."""
    if not best:
        raise ValueError("classify needs the best composition of at least one batch")
    batches = sorted(best)
    shares = {b: megakernel_layer_share(best[b]) for b in batches}
    described = ", ".join(f"batch {b}: {shares[b]:.0%} of layers in megakernels" for b in batches)
    if all(v == 0 for v in shares.values()):
        return Classification(Category.AVERSE, shares, f"no megakernel wins at any batch ({described})")
    xs = [math.log2(b) for b in batches]
    mean_x, mean_y = sum(xs) / len(xs), sum(shares.values()) / len(xs)
    slope = sum((x - mean_x) * (shares[b] - mean_y) for x, b in zip(xs, batches))
    if abs(slope) < 1e-12:
        same = all(best[b] == best[batches[0]] for b in batches)
        why = "one composition wins at every batch" if same else "the megakernel share holds while the cuts move"
        return Classification(Category.STABLE, shares, f"{why} ({described})")
    if slope < 0:
        return Classification(Category.RECEDING, shares, f"megakernels cover less as the batch grows ({described})")
    return Classification(Category.ADVANCING, shares, f"megakernels cover more as the batch grows ({described})")


def iter_pieces(compositions: Sequence[Composition]) -> Iterator[Piece]:
    """Every distinct megakernel piece among `compositions` (what the builder compiles and simulates)."""
    seen: set[Piece] = set()
    for composition in compositions:
        for piece in composition.pieces:
            if piece.backend is Backend.MEGAKERNEL and piece not in seen:
                seen.add(piece)
                yield piece


def model_layout(model: object) -> tuple[RegionLayout, ...]:
    """The frame of `model` as the search sees it, from what the model declares (models.region_backends:
    its decoder regions in its order, each network's DecoderView): layers, whether a megakernel may cover
    part of them (decoder regions yes; the code-predictor loop is one unit), and the bytes per stream that
    a cut moves (the region's hidden state); then each executor region with a megakernel backend
    (executor.megakernel.megakernel_region_names) as one uncuttable unit."""
    from tilevox.engine_builder.regions.spec import RegionKind, region_spec
    from tilevox.executor.megakernel import megakernel_region_names
    from tilevox.models.region_backends import region_module, region_names

    layout = []
    for name in region_names(model):
        network = region_module(model, name)
        view = network.decoder_view()
        element = next(network.parameters()).element_size()
        layout.append(
            RegionLayout(
                name=name,
                num_layers=len(view.layers),
                cuttable=region_spec(name).kind is RegionKind.DECODER,
                boundary_bytes_per_row=view.hidden_size * element,
            )
        )
    if not layout:
        raise ValueError(f"{type(model).__name__} declares no decoder regions to compose")
    decoders = set(region_names(model))
    for name in megakernel_region_names(model):
        if name not in decoders:
            layout.append(RegionLayout(name=name, num_layers=1, cuttable=False, executor=True))
    return tuple(layout)
