"""tilevox: model definitions, checkpoint loaders and streaming state."""
