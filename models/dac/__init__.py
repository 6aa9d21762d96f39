"""DAC (Descript Audio Codec) 44.1 kHz: config, codec (encoder, residual quantizer, decoder), loader,
streaming decode. The oracle tests compare with `transformers`' DacModel (4.57).
Imports: models.dac submodules only.
"""

from tilevox.models.dac.config import DAC_PRESETS, DacConfig
from tilevox.models.dac.model import DacCodec, decoder_reach_frames
from tilevox.models.dac.streaming import DacStreamDecoder, push_many
from tilevox.models.dac.weights import load_dac, random_dac

__all__ = [
    "DAC_PRESETS",
    "DacCodec",
    "DacConfig",
    "DacStreamDecoder",
    "decoder_reach_frames",
    "load_dac",
    "push_many",
    "random_dac",
]
