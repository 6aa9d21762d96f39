"""tilevox: engine_builder."""
