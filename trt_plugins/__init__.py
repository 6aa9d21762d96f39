"""tilevox: trt_plugins."""
