"""NH-TTS: the non-hierarchical codec-LM family (all codebooks of a frame in one decoder step, offset by a
delay pattern), served through Dia-1.6B (byte-level text encoder, 9 DAC 44.1 kHz codebooks).
Modules are imported lazily by models.registry (`tilevox.models.nh_tts.loader`).
"""
