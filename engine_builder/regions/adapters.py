"""The compiler's view of a decoder network: whatever the network's own `decoder_view()` declares.

The weight view (`DecoderView`, `LayerWeights`, `ModelFamily`) is defined by models.decoder_view and
each network implements it; this module never tests a network's class or reads its attributes.
Imports: torch, models.decoder_view.
"""

from __future__ import annotations

import torch

from tilevox.models.decoder_view import DecoderView, LayerWeights, ModelFamily

__all__ = ["DecoderView", "LayerWeights", "ModelFamily", "decoder_view"]


def decoder_view(module: torch.nn.Module) -> DecoderView:
    """`module.decoder_view()`; TypeError for a module that declares no decoder view."""
    declare = getattr(module, "decoder_view", None)
    if declare is None:
        raise TypeError(
            f"{type(module).__name__} declares no decoder view (a region runs networks that implement "
            "decoder_view(), see models.decoder_view)"
        )
    view = declare()
    if not isinstance(view, DecoderView):
        raise TypeError(f"{type(module).__name__}.decoder_view() returned {type(view).__name__}, not a DecoderView")
    return view
