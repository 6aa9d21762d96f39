"""Fixtures for the XCodec2 tests: the xcodec2 package's own decoder classes, imported on CPU.

xcodec2 0.1.5 imports `torchaudio` (never used by the decoder) and `torchtune.modules`, whose
package __init__ pulls torchao, datasets and more. Neither is needed to run the decoder, so the
package is imported with stand-ins: an empty `torchaudio`, and a `torchtune.modules` exposing
torchtune's genuine RotaryPositionalEmbeddings, loaded from its installed source file.
sys.modules is restored afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest


def _load_torchtune_rope() -> type:
    spec = importlib.util.find_spec("torchtune")  # locates the package without running its __init__
    if spec is None or spec.origin is None:
        pytest.skip("torchtune is not installed (pip install --no-deps torchtune==0.6.1)")
    source = Path(spec.origin).parent / "modules" / "position_embeddings.py"
    file_spec = importlib.util.spec_from_file_location("_tilevox_torchtune_position_embeddings", source)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module.RotaryPositionalEmbeddings


@contextlib.contextmanager
def _stand_ins(rope_cls: type):
    modules = {
        "torchaudio": types.ModuleType("torchaudio"),
        "torchtune": types.ModuleType("torchtune"),
        "torchtune.modules": types.ModuleType("torchtune.modules"),
    }
    modules["torchtune.modules"].RotaryPositionalEmbeddings = rope_cls
    modules["torchtune"].modules = modules["torchtune.modules"]
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


@pytest.fixture(scope="session")
def xcodec2_modeling():
    """The module `xcodec2.modeling_xcodec2` (XCodec2Model; its decoder classes come with it)."""
    for name in ("xcodec2", "vector_quantize_pytorch", "transformers"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed; see the XCodec2 pip lines in models/xcodec2/__init__.py")
    rope_cls = _load_torchtune_rope()
    # transformers probes importlib for torchaudio when it is first imported: import it before
    # the stand-ins so it sees the real environment.
    importlib.import_module("transformers")
    with _stand_ins(rope_cls):
        return importlib.import_module("xcodec2.modeling_xcodec2")


@pytest.fixture(scope="session")
def xcodec2_vocos(xcodec2_modeling):
    """The module `xcodec2.vq.codec_decoder_vocos` (CodecDecoderVocos, ISTFT, ...)."""
    return sys.modules["xcodec2.vq.codec_decoder_vocos"]
