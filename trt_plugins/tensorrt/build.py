"""Build libtilevox_trt_plugins.so and libtilevox_lean_harness.so: `python -m tilevox.trt_plugins.tensorrt.build`.

Compiles the IPluginV3 shims against the TensorRT headers in $TENSORRT_INCLUDE_DIR (not redistributed with
tilevox: use your TensorRT install, container or a checkout of the TensorRT OSS `include/`), links them to
libtilevox_kernels.so (build that first: `python -m tilevox.trt_plugins.build`), and exports only getCreators and
setLoggerFinder. No TensorRT or CUDA library is linked; the CUDA headers are needed for cudaStream_t.
`--megakernel-region` (PluginBuildConfig(megakernel_region=True)) also compiles the MegakernelRegion plugin
(megakernel_region_plugin.cpp; not yet run on a GPU, so not in the default build): it uploads its program and
copies state, so it links the static CUDA runtime ($CUDA_HOME/lib64/libcudart_static.a).
The plugin library goes next to the kernel library (rpath $ORIGIN). Imports: standard library, trt_plugins.library.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tilevox.trt_plugins.library import kernels_library_path

__all__ = [
    "HARNESS_LIBRARY_NAME",
    "PLUGIN_LIBRARY_NAME",
    "TENSORRT_INCLUDE_ENV_VAR",
    "PluginBuildConfig",
    "PluginBuildError",
    "build_plugins",
    "find_cuda_include_dir",
    "main",
]

TENSORRT_INCLUDE_ENV_VAR = "TENSORRT_INCLUDE_DIR"
PLUGIN_LIBRARY_NAME = "libtilevox_trt_plugins.so"
HARNESS_LIBRARY_NAME = "libtilevox_lean_harness.so"
_HERE = Path(__file__).resolve().parent
_CSRC = _HERE.parent / "csrc"
PLUGIN_SOURCES = ("swiglu_plugin_common.cpp", "swiglu_gateup_plugin.cpp", "swiglu_mlp_plugin.cpp")
MEGAKERNEL_REGION_SOURCE = "megakernel_region_plugin.cpp"  # opt-in: written, syntax-checked, not yet run on a GPU
_CXXFLAGS = ("-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wno-deprecated-declarations")


class PluginBuildError(RuntimeError):
    """The plugin library cannot be built here (no TensorRT headers, no kernel library, or a compile error)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginBuildConfig:
    """Inputs of the plugin build; `out_dir` defaults to the kernel library's folder."""

    tensorrt_include_dir: Path
    kernels_library: Path
    cuda_include_dir: Path
    out_dir: Path
    cxx: str = "g++"
    megakernel_region: bool = False  # also the MegakernelRegion plugin (links the static CUDA runtime)

    def __post_init__(self) -> None:
        if not (Path(self.tensorrt_include_dir) / "NvInferRuntime.h").is_file():
            raise PluginBuildError(f"{self.tensorrt_include_dir} holds no NvInferRuntime.h: not a TensorRT include dir")
        if not Path(self.kernels_library).is_file():
            raise PluginBuildError(
                f"kernel library {self.kernels_library} not found: build it first with `python -m tilevox.trt_plugins.build`"
            )
        if not (Path(self.cuda_include_dir) / "cuda_runtime_api.h").is_file():
            raise PluginBuildError(f"{self.cuda_include_dir} holds no cuda_runtime_api.h (set CUDA_HOME)")


def find_cuda_include_dir() -> Path:
    """$CUDA_HOME/include, else the include folder beside the nvcc on PATH, else /usr/local/cuda/include."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for c in candidates:
        if (c / "cuda_runtime_api.h").is_file():
            return c
    raise PluginBuildError(f"no CUDA headers (cuda_runtime_api.h) in {', '.join(map(str, candidates))}; set CUDA_HOME")


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PluginBuildError(f"command failed: {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")


def build_plugins(cfg: PluginBuildConfig) -> tuple[Path, Path]:
    """Compile and link both libraries; returns (plugin library, harness library)."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{cfg.tensorrt_include_dir}", f"-I{cfg.cuda_include_dir}", f"-I{_CSRC}", f"-I{_HERE}"]
    kernels = Path(cfg.kernels_library).resolve()
    plugin = out / PLUGIN_LIBRARY_NAME
    sources, defines, cudart = list(PLUGIN_SOURCES), [], []
    if cfg.megakernel_region:
        sources.append(MEGAKERNEL_REGION_SOURCE)
        defines.append("-DTILEVOX_MEGAKERNEL_REGION")
        cudart = [
            f"-L{Path(cfg.cuda_include_dir).parent / 'lib64'}",
            "-l:libcudart_static.a",
            "-lrt",
            "-lpthread",
            "-ldl",
        ]
    _run(
        [
            cfg.cxx,
            *_CXXFLAGS,
            *defines,
            *includes,
            "-shared",
            *(str(_HERE / s) for s in sources),
            "-o",
            str(plugin),
            # like NVIDIA's version-compatible plugin library: two exported symbols, nothing left unresolved
            f"-Wl,--version-script={_HERE / 'exports.map'}",
            "-Wl,--no-undefined",
            "-Wl,-Bsymbolic",
            f"-L{kernels.parent}",
            f"-l:{kernels.name}",
            *cudart,
            "-Wl,-rpath,$ORIGIN",
        ]
    )
    harness = out / HARNESS_LIBRARY_NAME
    _run([cfg.cxx, *_CXXFLAGS, *includes, "-shared", str(_HERE / "lean_harness.cpp"), "-o", str(harness), "-ldl"])
    return plugin, harness


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tilevox.trt_plugins.tensorrt.build", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the kernel library's folder)")
    parser.add_argument("--cxx", default=os.environ.get("CXX", "g++"), help="C++ compiler (default: $CXX or g++)")
    parser.add_argument(
        "--megakernel-region",
        action="store_true",
        help="also build the MegakernelRegion plugin (not yet run on a GPU; links the static CUDA runtime)",
    )
    args = parser.parse_args(argv)
    include = os.environ.get(TENSORRT_INCLUDE_ENV_VAR)
    try:
        if not include:
            raise PluginBuildError(
                f"${TENSORRT_INCLUDE_ENV_VAR} is not set: point it at the folder holding NvInferRuntime.h "
                "(TensorRT is not redistributed with tilevox)"
            )
        kernels = kernels_library_path()
        cfg = PluginBuildConfig(
            tensorrt_include_dir=Path(include),
            kernels_library=kernels,
            cuda_include_dir=find_cuda_include_dir(),
            out_dir=args.out or kernels.parent,
            cxx=args.cxx,
            megakernel_region=args.megakernel_region,
        )
        plugin, harness = build_plugins(cfg)
    except PluginBuildError as exc:
        print(f"trt_plugins.tensorrt.build: error: {exc}", file=sys.stderr)
        return 1
    print(f"built {plugin}\nbuilt {harness}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
