"""The build's profile cache: measurements reused by a later `tilevox build` on the same machine and model.

Like TensorRT's timing cache, an entry is keyed by everything that changes the number: the machine
(GPU, driver, kernel library hash, torch version), the model (its id, dtype and a signature of its
parameters' names, shapes and dtypes, so a checkpoint with another config never matches), what was
measured (one backend's per-region times, or one composition's whole step; for a measurement that ran a
megakernel, the region compiler's tiling too) and how (batch, warm-up and timed steps). A hit returns the stored milliseconds; a miss measures and stores. The file is JSON
(`tilevox.profile_cache/1`), written atomically; an unreadable file or another format is an error, not
an empty cache (delete it, or build with `--profile-cache none`). Imports: standard library, torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

__all__ = ["CACHE_FORMAT", "ProfileCache", "ProfileCacheError", "model_signature"]

CACHE_FORMAT = "tilevox.profile_cache/1"


class ProfileCacheError(RuntimeError):
    """The cache file cannot be read or has another format."""


def model_signature(modules: Iterable[torch.nn.Module]) -> str:
    """sha256 (16 hex digits) of every parameter's and buffer's name, shape and dtype: equal for two loads of
    the same architecture and precision, different for another config (values are not read)."""
    digest = hashlib.sha256()
    for index, module in enumerate(modules):
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            digest.update(f"{index}.{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return digest.hexdigest()[:16]


def _encode(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no inf: None = measured, not usable


def _decode(value: float | None) -> float:
    return math.inf if value is None else float(value)


class ProfileCache:
    """Entries `key -> {name: ms}` under a fixed context (machine + model); `path` None keeps them in memory."""

    def __init__(self, path: Path | None, context: Mapping[str, str]) -> None:
        self.path, self.context = path, dict(context)
        self.hits = self.misses = 0
        self._entries: dict[str, dict[str, float | None]] = {}
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ProfileCacheError(f"{path}: unreadable profile cache ({exc}); delete it to start afresh") from exc
            if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
                raise ProfileCacheError(
                    f"{path}: not a {CACHE_FORMAT} file (format {data.get('format') if isinstance(data, dict) else '?'})"
                )
            self._entries = dict(data.get("entries", {}))

    def _key(self, kind: str, **what: object) -> str:
        return json.dumps({**self.context, "kind": kind, **what}, sort_keys=True)

    def get(self, kind: str, **what: object) -> dict[str, float] | None:
        """The stored times of this measurement (ms by name; inf where the measurement was unusable), or None."""
        entry = self._entries.get(self._key(kind, **what))
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        return {name: _decode(ms) for name, ms in entry.items()}

    def put(self, kind: str, times: Mapping[str, float], **what: object) -> None:
        self._entries[self._key(kind, **what)] = {name: _encode(ms) for name, ms in times.items()}

    def save(self) -> None:
        """Write the file atomically (a crash mid-write leaves the previous one); no-op without a path."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"format": CACHE_FORMAT, "entries": self._entries}, indent=0, sort_keys=True) + "\n"
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def __len__(self) -> int:
        return len(self._entries)
