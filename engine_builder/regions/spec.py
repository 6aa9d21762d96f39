"""What to compile into one megakernel region, and how finely to tile it.

`RegionSpec` names a contiguous range of a model's per-step ops; `TilingConfig` sets tile sizes
(the granularity of instructions and therefore of dependencies). Both are frozen and validated.
Imports: stdlib, models.region_backends (the region names).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from tilevox.models.region_backends import CODE_PREDICTOR_LOOP, CODEC_DECODE, DECODER_STEP, NH_DECODER_STEP, TALKER_STEP

__all__ = ["RegionKind", "RegionSpec", "TilingConfig", "region_spec"]


class RegionKind(enum.Enum):
    DECODER = "decoder"  # layers [first_layer, stop_layer) of a decoder step, optionally with embed / head
    CODE_PREDICTOR_LOOP = "code_predictor_loop"  # the whole Qwen3-TTS code-predictor loop of one frame


@dataclass(frozen=True, slots=True, kw_only=True)
class RegionSpec:
    """DECODER: step input is token ids (embed_input, Llama) or a hidden state (input buffer `x_in`);
    with lm_head the region ends with final norm + head + sampling, and with num_steps > 1 it loops,
    each sampled token's embedding feeding the next step (a full decode step in one launch).
    CODE_PREDICTOR_LOOP: inputs talker hidden + codebook-0 embedding, outputs codes 1..Q-1."""

    kind: RegionKind = RegionKind.DECODER
    first_layer: int = 0
    stop_layer: int | None = None  # None: through the last layer
    embed_input: bool = False
    lm_head: bool = False
    num_steps: int = 1
    vocab_limit: int | None = None  # sample among logits[:vocab_limit] (None: the whole head)

    def __post_init__(self) -> None:
        if self.first_layer < 0 or (self.stop_layer is not None and self.stop_layer <= self.first_layer):
            raise ValueError(f"layer range must satisfy 0 <= first < stop, got [{self.first_layer}, {self.stop_layer})")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.kind is RegionKind.DECODER and self.num_steps > 1 and not (self.embed_input and self.lm_head):
            raise ValueError(
                "a multi-step decoder region must start from token ids (embed_input) and end "
                "with the head (lm_head): each step's sampled token feeds the next"
            )
        if self.kind is RegionKind.CODE_PREDICTOR_LOOP and (
            self.first_layer != 0
            or self.stop_layer is not None
            or self.embed_input
            or self.lm_head
            or self.num_steps != 1
        ):
            raise ValueError(
                "CODE_PREDICTOR_LOOP covers the whole predictor: leave the layer range, "
                "embed_input, lm_head and num_steps at their defaults"
            )
        if self.vocab_limit is not None and self.vocab_limit < 1:
            raise ValueError(f"vocab_limit must be >= 1, got {self.vocab_limit}")

    @classmethod
    def layers(cls, first: int, stop: int, *, embed_input: bool = False, lm_head: bool = False) -> RegionSpec:
        return cls(first_layer=first, stop_layer=stop, embed_input=embed_input, lm_head=lm_head)

    @classmethod
    def full_step(cls, num_steps: int = 1) -> RegionSpec:
        return cls(embed_input=True, lm_head=True, num_steps=num_steps)

    @classmethod
    def code_predictor_loop(cls) -> RegionSpec:
        return cls(kind=RegionKind.CODE_PREDICTOR_LOOP)

    def piece(self, first: int, stop: int, num_layers: int) -> RegionSpec:
        """Layers [first, stop) of this single-step decoder region of `num_layers` layers: it keeps this
        region's token input only from layer 0 (else it takes `x_in`, the residual stream) and its head only
        through the last layer (else it ends with `x_out`), so that pieces cut at layer boundaries chain into
        the whole region (executor.split)."""
        if self.kind is not RegionKind.DECODER or self.num_steps != 1:
            raise ValueError("only a single-step decoder region is cut at layer boundaries")
        if not 0 <= first < stop <= num_layers:
            raise ValueError(f"piece [{first}, {stop}) is not within the region's {num_layers} layers")
        return RegionSpec(
            first_layer=first,
            stop_layer=stop,
            embed_input=self.embed_input and first == 0,
            lm_head=self.lm_head and stop == num_layers,
            vocab_limit=self.vocab_limit,
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value}


def region_spec(name: str) -> RegionSpec:
    """The compiled form of a model region named in models.region_backends (the names every CLI uses)."""
    specs = {
        DECODER_STEP: RegionSpec.full_step(1),
        TALKER_STEP: RegionSpec(lm_head=True),
        NH_DECODER_STEP: RegionSpec(lm_head=True),  # summed embeddings in, all channels' logits out
        # Qwen3-TTS codec decode: its sliding-window transformer (input and output projections); the executor's
        # backend runs the codec's convolutions around it.
        CODEC_DECODE: RegionSpec(lm_head=True),
        CODE_PREDICTOR_LOOP: RegionSpec.code_predictor_loop(),
    }
    if name not in specs:
        raise ValueError(f"no region named {name!r}; regions: {', '.join(specs)}")
    return specs[name]


@dataclass(frozen=True, slots=True, kw_only=True)
class TilingConfig:
    """Rows per matrix-vector tile (Hazy uses 16 at batch 1), query/key/value heads per QKV tile,
    batch rows per sampling tile, and the KV partitioning of attention: partitions of at least
    min_partition_tokens keys, at most max_partitions of them (partition_tokens overrides both);
    batch rows per cross-attention tile (one tile per kv group and row range).

    sm_balanced: every matrix-vector stage (projections, MLP, heads) is cut into tiles of ceil(rows / num_sms)
    rows rounded up to a multiple of matvec_rows, instead of matvec_rows (lm_head_rows for heads): each SM runs
    at most one tile of the stage, so its fixed costs per instruction (record, buffer lookups, counter wait,
    staging and normalising the input rows) are paid once per stage rather than once per 16 rows. Measured on an
    H100 (2026-12-06, benchmarks/results/megakernel_variants_h100_e666ade.json, Llasa-1B step): 2.77 -> 2.32 ms
    at batch 1 and 6.57 -> 5.25 ms at batch 32; Qwen3-TTS-0.6B frame 8.17 -> 8.20 ms at batch 1 (equal) and
    20.76 -> 19.28 ms at batch 32 (benchmarks/results/megakernel_qwen_balanced_h100_e666ade_log.txt). On by default
    since 2026-12-07, when the correctness matrix passed with it (H100, with attn_rows 8 and split QKV too:
    benchmarks/results/megakernel_correctness_h100_971fa20_balanced_attn8_split.json) and the GPU tests passed
    with it as the default.

    attn_rows: batch rows per attention tile (ATTN_PARTIAL per kv group, partition and row range; ATTN_REDUCE per
    kv group and row range); None: all rows in one tile, so at large batch a tile streams every row's keys.
    8 by default since 2026-12-07 (H100, same run, benchmarks/results/megakernel_variants_h100_cd86aaf_*.json):
    the Qwen3-TTS predictor loop, whose one partition leaves the rows as attention's only parallelism, 12.79 ->
    9.74 ms at batch 32 and 5.66 -> 5.60 at batch 1; the Llama-1B step (8 partitions) 5.44 / 5.45 at 32 and 2.39 /
    2.38 at 1. 4 rows made both slower at batch 32 (12.27; Llama 9.01: the partials and reduces multiply).

    reduce_single_partition: keep the ATTN_REDUCE stage when one partition covers the region's context (the
    Qwen3-TTS code predictor's); False (default since 2026-12-07): ATTN_PARTIAL writes attn_out itself and no
    reduce stage follows (one dependent stage fewer per layer). H100, same run: the predictor loop 6.58 -> 5.87
    ms at batch 1 and 13.80 -> 13.01 at 32; the GPU tests pass with it (tests/trt_plugins/megakernel).

    split_qkv: a layer's q, k and v projections as one stage of balanced RMSNORM_LINEAR tiles writing the raw
    projections, instead of RMSNORM_QKV_ROPE_APPEND's one whole head per tile (the per-head norm and rope need
    the whole head): ATTN_PARTIAL norms and ropes its queries and the newest key itself, and KV_APPEND writes
    that key and value to the cache beside the attention, for the next step. Same number of dependent stages
    per layer; the projection stage's tiles stream ceil(rows / SMs) rows each rather than head_dim rows on a
    fraction of the SMs (Qwen3-TTS: 32 tiles of 128 rows for 132 SMs). Off by default until it has run on a GPU.

    opcode_affinity: the list scheduler puts each instruction on the SM that ran its opcode most recently among
    those free by the time it could start on any (engine_builder.regions.schedule): the same predicted start
    times, fewer SMs fetching each opcode's body. H100, 2026-12-07: a 16-key ATTN_PARTIAL of the Qwen3-TTS
    predictor takes 22.3 us on an SM that last ran something else and 13.4 us run again at once
    (TILEVOX_MK_REPEAT_ATTN), so about 40 % of it is cold start. Off by default: same run (H100, 2026-12-07),
    the predictor loop 6.58 -> 6.37 ms at batch 1 but 13.80 -> 14.09 at 32 (5.87 -> 5.64 and 13.01 -> 12.77 with
    one-partition attention), the Llama-1B step 2.44 -> 2.46 and 5.52 -> 5.52. `--megakernel-tiling
    opcode_affinity=on` turns it on.

    Partitions of at least 64 keys (256 until 2026-12-06): on an H100, Llama-1B step at context 512, 64-key
    partitions took 2.88 / 3.35 / 6.67 ms at batch 1 / 8 / 32 against 2.81 / 3.95 / 8.98 ms with 256
    (same run, benchmarks/results/megakernel_variants_h100_4266d9f_pt{64,256}.json); the benchmarks and the correctness
    matrix already used 64."""

    matvec_rows: int = 16
    lm_head_rows: int = 64
    heads_per_qkv_tile: int = 1
    sample_rows: int = 1
    min_partition_tokens: int = 64
    max_partitions: int = 24
    partition_tokens: int | None = None
    cross_attn_rows: int = 4
    sm_balanced: bool = True
    attn_rows: int | None = 8
    reduce_single_partition: bool = False
    split_qkv: bool = False
    opcode_affinity: bool = False

    def __post_init__(self) -> None:
        for name in (
            "matvec_rows",
            "lm_head_rows",
            "heads_per_qkv_tile",
            "sample_rows",
            "min_partition_tokens",
            "max_partitions",
            "cross_attn_rows",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attn_rows is not None and self.attn_rows < 1:
            raise ValueError(f"attn_rows must be >= 1 or None, got {self.attn_rows}")
        if self.partition_tokens is not None and self.partition_tokens < 1:
            raise ValueError(f"partition_tokens must be >= 1, got {self.partition_tokens}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TilingConfig:
        """The tiling of `data` (to_dict's form); fields it lacks take today's defaults. ValueError for a field
        this version does not know or a value of the wrong type."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown tiling fields {unknown}; known: {', '.join(known)}")
        for name, value in data.items():
            if name in _BOOL_FIELDS:
                ok, kind = isinstance(value, bool), "bool"
            else:
                optional = "None" in str(known[name].type)
                ok = (value is None and optional) or (isinstance(value, int) and not isinstance(value, bool))
                kind = "int or None" if optional else "int"
            if not ok:
                raise ValueError(f"tiling field {name}: {value!r} is not a {kind}")
        return cls(**data)

    @classmethod
    def parse(cls, text: str, base: TilingConfig | None = None) -> TilingConfig:
        """`base` (None: the defaults) with `text`'s overrides, `name=value` pairs separated by commas (`on` /
        `off` for switches, `none` for an unset size), e.g. `split_qkv=on,attn_rows=16`."""
        data = (base or cls()).to_dict()
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            name, value = name.strip(), value.strip().lower()
            if not sep or name not in data:
                raise ValueError(f"tiling override {item!r}: expected name=value with a name of {', '.join(data)}")
            if name in _BOOL_FIELDS:
                if value not in ("on", "off", "true", "false", "1", "0"):
                    raise ValueError(f"tiling override {item!r}: {name} takes on or off")
                data[name] = value in ("on", "true", "1")
            elif value == "none":
                data[name] = None
            else:
                try:
                    data[name] = int(value)
                except ValueError:
                    raise ValueError(f"tiling override {item!r}: {name} takes an integer") from None
        return cls.from_dict(data)

    def resolve_partition_tokens(self, max_context: int) -> int:
        if self.partition_tokens is not None:
            return self.partition_tokens
        return max(self.min_partition_tokens, math.ceil(max_context / self.max_partitions))


_BOOL_FIELDS = frozenset(f.name for f in fields(TilingConfig) if f.type in ("bool", bool))
