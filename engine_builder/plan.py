"""The plan file: per batch bucket, the composition the runtime follows and the numbers it was chosen by.

A plan is a build artefact (JSON, `FORMAT` versioned) with provenance: the GPU, driver, kernel library
hash, commit and profile date it was measured under. `load_plan` checks the schema and every composition
against the model's region layout, and refuses a plan whose provenance does not match the machine it is
loaded on (a plan measured elsewhere predicts nothing here). `Plan.bucket_for(batch)` is the plan of the
smallest bucket that holds `batch` streams; `tiling`, the megakernel tiling the plan was measured with.
Format 2 added executor regions to the layout (`RegionLayout.executor`: the Qwen3-TTS codec decode); a
format-1 plan (decoder regions only) still loads, and apply_plan leaves the regions it lacks on the
executor's graph. Imports: stdlib, engine_builder.composition, engine_builder.regions.spec.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tilevox.engine_builder.composition import Composition, Ranked, RegionLayout
from tilevox.engine_builder.regions.spec import TilingConfig

__all__ = [
    "FORMAT",
    "MATCHED_BY_DEFAULT",
    "READABLE_FORMATS",
    "BucketPlan",
    "Plan",
    "PlanError",
    "Provenance",
    "load_plan",
    "save_plan",
]

FORMAT = "tilevox.plan/2"
# Formats load_plan reads: 1 (decoder regions only) and 2 (executor regions in the layout too).
READABLE_FORMATS = ("tilevox.plan/1", FORMAT)


class PlanError(ValueError):
    """A plan file that is malformed, inconsistent with the model, or measured on another machine."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Provenance:
    gpu: str
    driver: str
    library_hash: str  # of the kernel library the megakernel pieces run on
    commit: str
    profile_date: str  # ISO 8601, when the costs were measured

    def mismatches(self, other: Provenance, keys: Sequence[str]) -> list[str]:
        return [
            f"{k}: plan {getattr(self, k)!r}, here {getattr(other, k)!r}"
            for k in keys
            if getattr(self, k) != getattr(other, k)
        ]


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketPlan:
    batch: int  # the largest number of streams this bucket serves
    composition: Composition
    predicted_step_s: float
    predicted_ttfa_s: float
    num_candidates: int  # how many compositions were ranked for it

    @classmethod
    def best_of(cls, batch: int, ranked: Sequence[Ranked]) -> BucketPlan:
        """The bucket's plan from a search's ranking (best first)."""
        if not ranked:
            raise PlanError(f"bucket {batch}: no candidates")
        top = ranked[0]
        return cls(
            batch=batch,
            composition=top.composition,
            predicted_step_s=top.step_s,
            predicted_ttfa_s=top.ttfa_s,
            num_candidates=len(ranked),
        )

    def to_dict(self) -> dict:
        return {
            "batch": self.batch,
            "composition": self.composition.to_list(),
            "label": self.composition.label(),
            "predicted_step_s": self.predicted_step_s,
            "predicted_ttfa_s": self.predicted_ttfa_s,
            "num_candidates": self.num_candidates,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    model: str
    provenance: Provenance
    layout: tuple[RegionLayout, ...]
    buckets: tuple[BucketPlan, ...]
    # The region compiler's tiling the megakernel pieces were measured with (TilingConfig.to_dict); apply_plan
    # compiles them with it, whatever today's defaults are. None: not recorded (plans before 2026-12-06, or a
    # build without the megakernel), so the caller's compiler decides.
    tiling: Mapping[str, Any] | None = None

    def validate(self) -> None:
        if not self.buckets:
            raise PlanError("a plan needs at least one batch bucket")
        batches = [b.batch for b in self.buckets]
        if batches != sorted(set(batches)) or batches[0] < 1:
            raise PlanError(f"bucket batches must be positive and strictly increasing, got {batches}")
        for bucket in self.buckets:
            try:
                bucket.composition.validate(self.layout)
            except ValueError as exc:
                raise PlanError(f"bucket {bucket.batch}: {exc}") from None
            if not (bucket.predicted_step_s > 0 and bucket.predicted_ttfa_s >= bucket.predicted_step_s):
                raise PlanError(f"bucket {bucket.batch}: predicted times must satisfy 0 < step <= ttfa")

    def bucket_for(self, batch: int) -> BucketPlan:
        for bucket in self.buckets:
            if bucket.batch >= batch:
                return bucket
        raise PlanError(f"batch {batch} is above the plan's largest bucket {self.buckets[-1].batch}")

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "model": self.model,
            "provenance": asdict(self.provenance),
            "layout": [asdict(r) for r in self.layout],
            "buckets": [b.to_dict() for b in self.buckets],
            **({} if self.tiling is None else {"tiling": dict(self.tiling)}),
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> Plan:
        if data.get("format") not in READABLE_FORMATS:
            raise PlanError(
                f"not a {FORMAT} plan (format {data.get('format')!r}; this version reads {', '.join(READABLE_FORMATS)})"
            )
        try:
            provenance = Provenance(**{f.name: str(data["provenance"][f.name]) for f in fields(Provenance)})
            layout = tuple(RegionLayout(**r) for r in data["layout"])
            if data["format"] != FORMAT and any(r.executor for r in layout):
                raise ValueError(f"a {data['format']} plan has decoder regions only")
            buckets = tuple(
                BucketPlan(
                    batch=int(b["batch"]),
                    composition=Composition.from_list(b["composition"]),
                    predicted_step_s=float(b["predicted_step_s"]),
                    predicted_ttfa_s=float(b["predicted_ttfa_s"]),
                    num_candidates=int(b["num_candidates"]),
                )
                for b in data["buckets"]
            )
            tiling = data.get("tiling")
            if tiling is not None:
                tiling = TilingConfig.from_dict(tiling).to_dict()
            plan = cls(model=str(data["model"]), provenance=provenance, layout=layout, buckets=buckets, tiling=tiling)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed plan: {type(exc).__name__}: {exc}") from None
        plan.validate()
        return plan


MATCHED_BY_DEFAULT = ("gpu", "driver", "library_hash")


def save_plan(plan: Plan, path: Path) -> None:
    plan.validate()
    path.write_text(json.dumps(plan.to_dict(), indent=1) + "\n")


def load_plan(
    path: Path, *, here: Provenance | None = None, match: Sequence[str] = MATCHED_BY_DEFAULT, model: str | None = None
) -> Plan:
    """Read and check a plan. With `here` (this machine's provenance), refuse one measured under another
    GPU, driver or kernel library (the `match` fields); with `model`, one built for another model."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read plan {path}: {exc}") from None
    plan = Plan.from_dict(data)
    if model is not None and plan.model != model:
        raise PlanError(f"plan {path} is for {plan.model}, not {model}")
    if here is not None:
        differ = plan.provenance.mismatches(here, match)
        if differ:
            raise PlanError(f"plan {path} was measured elsewhere ({'; '.join(differ)}); rebuild it here")
    return plan
