"""tilevox: streaming text-to-speech inference for NVIDIA Hopper GPUs.

Everything installs under this one name. The design folders stay at the repository root and are
mapped into it by `setup.py` (setuptools `package_dir`): `trt_plugins/` is `tilevox.trt_plugins`,
`models/` is `tilevox.models`, `executor/` is `tilevox.executor`, `engine_builder/` is
`tilevox.engine_builder`, `server/` is `tilevox.server`. Imports flow one way: trt_plugins <- models <- executor <- engine_builder <- server.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tilevox")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
