"""TensorRT IPluginV3 shims for the tilevox ops (C++ sources here, built by `python -m tilevox.trt_plugins.tensorrt.build`).

`plugin_library_path()` says where the built plugin library is ($TILEVOX_TRT_PLUGINS_LIB, else next to the
kernel library); load it into a TensorRT plugin registry with `loadLibrary` / trtexec `--dynamicPlugins`.
Imports: standard library, trt_plugins.library.
"""

from __future__ import annotations

import os
from pathlib import Path

from tilevox.trt_plugins.library import kernels_library_path

__all__ = ["PLUGINS_LIBRARY_ENV_VAR", "harness_library_path", "plugin_library_path"]

PLUGINS_LIBRARY_ENV_VAR = "TILEVOX_TRT_PLUGINS_LIB"


def plugin_library_path() -> Path:
    """$TILEVOX_TRT_PLUGINS_LIB if set, else libtilevox_trt_plugins.so beside the kernel library."""
    env = os.environ.get(PLUGINS_LIBRARY_ENV_VAR)
    return Path(env) if env else kernels_library_path().parent / "libtilevox_trt_plugins.so"


def harness_library_path() -> Path:
    """The lean-runtime test harness, built beside the plugin library."""
    return plugin_library_path().parent / "libtilevox_lean_harness.so"
