"""Build an XCodec2Decoder with seeded random weights, or load it from XCodec2's checkpoint.

The official checkpoint (HKUSTAudio/xcodec2, `XCodec2Model.from_pretrained`) is a
`model.safetensors` whose keys are the `XCodec2Model` module paths: `generator.*` (decoder and
quantizer), `fc_post_a.*`, plus encoder-side tensors listed in `IGNORED_PREFIXES`.
Imports: torch, models.errors, models.checkpoint_io and models.xcodec2 only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tilevox.models.checkpoint_io import check_tensor_dtype, read_safetensors
from tilevox.models.errors import CheckpointError
from tilevox.models.xcodec2.config import XCodec2Config
from tilevox.models.xcodec2.model import XCodec2Decoder

__all__ = [
    "CHECKPOINT_FILE",
    "IGNORED_PREFIXES",
    "checkpoint_name",
    "load_xcodec2_decoder",
    "random_xcodec2_decoder",
]

CHECKPOINT_FILE = "model.safetensors"

# Checkpoint tensors the decoder does not use: the Wav2Vec2-BERT semantic model and its
# adapter, the acoustic encoder, the pre-quantizer projection, and FSQ's input projection.
IGNORED_PREFIXES: tuple[str, ...] = (
    "semantic_model.",
    "SemanticEncoder_module.",
    "CodecEnc.",
    "fc_prior.",
    "generator.quantizer.project_in.",
)

# Our parameter-name prefix -> the checkpoint's.
_PREFIX_MAP: tuple[tuple[str, str], ...] = (
    ("fsq_project_out.", "generator.quantizer.project_out."),
    ("fc_post_a.", "fc_post_a."),
    ("backbone.", "generator.backbone."),
    ("head_out.", "generator.head.out."),
)

# A persistent buffer of the package (its Hann window); checked against ours when present.
_WINDOW_KEY = "generator.head.istft.window"


def checkpoint_name(name: str) -> str:
    """Our state_dict key -> the official checkpoint's key."""
    for ours, theirs in _PREFIX_MAP:
        if name.startswith(ours):
            return theirs + name.removeprefix(ours)
    raise KeyError(f"{name!r} has no checkpoint counterpart")


def random_xcodec2_decoder(
    config: XCodec2Config,
    *,
    seed: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> XCodec2Decoder:
    """A decoder with seeded random weights, allocated on `device` directly.

    Same seed and device give the same weights (the draws run in module order on one generator)."""
    device = torch.device(device)
    model = XCodec2Decoder(config, device=device, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            # Norms keep their fresh scale 1 / shift 0; linears and convs get fan-in scaled
            # normals so activations keep unit size through the depth.
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d)):
                fan_in = module.weight[0].numel()
                module.weight.normal_(0.0, fan_in**-0.5, generator=generator)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    if not path.exists():
        raise CheckpointError(f"{path}: missing; expected XCodec2's {CHECKPOINT_FILE} (or a .pt/.pth/.ckpt file)")
    if path.suffix == ".safetensors":
        # Reads only what the decoder may use: the semantic model alone is ~2.4 GB in fp32.
        return read_safetensors(path, skip_prefixes=IGNORED_PREFIXES)
    if path.suffix in (".pt", ".pth", ".ckpt", ".bin"):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"{path}: unreadable torch checkpoint ({exc})") from exc
        # Lightning checkpoints wrap the weights in "state_dict".
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{path}: not a state_dict of tensors")
        return state
    raise CheckpointError(f"{path}: unknown checkpoint format {path.suffix!r}")


def _read_config(path: Path) -> XCodec2Config:
    config_path = (path if path.is_dir() else path.parent) / "config.json"
    if not config_path.exists():
        return XCodec2Config.preset("full")
    try:
        return XCodec2Config.from_dict(json.loads(config_path.read_text()), source=str(config_path))
    except (OSError, json.JSONDecodeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{config_path}: not a usable XCodec2 config ({exc})") from exc


def load_xcodec2_decoder(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    config: XCodec2Config | None = None,
) -> XCodec2Decoder:
    """Load the decoder from a checkpoint directory (config.json + model.safetensors) or file.

    `config` defaults to the directory's config.json, else the full preset. Tensors under
    `IGNORED_PREFIXES` are skipped; a missing, mis-shaped or unexpected decoder tensor raises
    CheckpointError naming it.
    """
    path = Path(path)
    config = config if config is not None else _read_config(path)
    state = _read_state_dict(path)
    model = XCodec2Decoder(config, device="meta", dtype=dtype)
    expected = {checkpoint_name(name): (name, p.shape) for name, p in model.named_parameters()}

    unexpected = sorted(
        key for key in state if key not in expected and key != _WINDOW_KEY and not key.startswith(IGNORED_PREFIXES)
    )
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise CheckpointError(f"{path}: {len(unexpected)} unexpected decoder tensor(s) for this config: {shown}")
    for key, (_, shape) in expected.items():
        if key not in state:
            raise CheckpointError(f"{path}: missing decoder tensor {key!r}")
        if tuple(state[key].shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {key!r} has shape {tuple(state[key].shape)}, expected {tuple(shape)}"
            )
        check_tensor_dtype(key, state[key], dtype, where=str(path))

    model = XCodec2Decoder(config, device=device, dtype=dtype)
    if _WINDOW_KEY in state:
        window = state[_WINDOW_KEY].float().to(model.window.device)
        if window.shape != model.window.shape or not torch.allclose(window, model.window, atol=1e-6):
            raise CheckpointError(f"{path}: tensor {_WINDOW_KEY!r} is not a periodic Hann window of {config.n_fft}")
    model.load_state_dict({name: state[key] for key, (name, _) in expected.items()}, strict=True)
    return model.eval()
