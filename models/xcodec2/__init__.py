"""XCodec2 decoder (the 16 kHz, 50 frames/s FSQ codec of Llasa TTS): config, model, loader, streaming.

The oracle tests compare with the reference package, installed without its torch pins:
    pip install --no-deps xcodec2==0.1.5 vector-quantize-pytorch==1.17.8 einx==0.4.3 \
        frozendict==2.5.1 torchtune==0.6.1
Imports: models.xcodec2 submodules only.
"""

from tilevox.models.xcodec2.config import XCodec2Config
from tilevox.models.xcodec2.model import XCodec2Decoder
from tilevox.models.xcodec2.streaming import XCodec2StreamDecoder
from tilevox.models.xcodec2.weights import load_xcodec2_decoder, random_xcodec2_decoder

__all__ = [
    "XCodec2Config",
    "XCodec2Decoder",
    "XCodec2StreamDecoder",
    "load_xcodec2_decoder",
    "random_xcodec2_decoder",
]
