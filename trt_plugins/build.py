"""Build libtilevox_kernels.so: `python -m tilevox.trt_plugins.build [--out DIR] [--jobs N] [--only NAME]`.

Compiles every translation unit under trt_plugins/csrc/ with nvcc for sm_90a (one CUTLASS instantiation
per file, ~1 min and ~3.3 GB each on 2 cores), in parallel, and links ONE shared library that does not
link torch (the torch ops load it through ctypes, the TensorRT plugins link it). Needs nvcc and the CUTLASS
4.x headers: the installed `nvidia-cutlass` wheel, or CUTLASS_DIR pointing at a CUTLASS checkout (the
folder holding include/cutlass). Objects are reused while newer than every source and header.
`--only NAME` compiles the matching translation units to objects and does not link (CI's compile check).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = [
    "BuildConfig",
    "BuildError",
    "NVCC_FLAGS",
    "build",
    "default_library_path",
    "find_cutlass_include_dirs",
    "find_nvcc",
    "list_sources",
    "main",
]

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "build"
LIBRARY_NAME = "libtilevox_kernels.so"
_DEFAULT_CUDA_ROOTS: tuple[str, ...] = ("/usr/local/cuda",)

# -DNDEBUG: without it ptxas serializes wgmma (C7510); sm_90a (not sm_90): plain sm_90 builds stub kernels
# that abort at run time; --expt-relaxed-constexpr: hundreds of CUTLASS warnings otherwise.
NVCC_FLAGS: tuple[str, ...] = (
    "-gencode",
    "arch=compute_90a,code=sm_90a",
    "-DNDEBUG",
    "--expt-relaxed-constexpr",
    "-std=c++17",
    "-O3",
    "-Xcompiler",
    "-fPIC",
)


class BuildError(RuntimeError):
    """The kernel library cannot be built here (missing nvcc or CUTLASS, or a compile error)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BuildConfig:
    """What to build and where.

    Attributes:
        out_dir: folder for obj/ and the shared library.
        num_jobs: translation units compiled at once (each needs ~3.3 GB of RAM).
        only: if set, compile only sources whose stem contains this text, and skip the link.
        verbose: print each nvcc command.
    """

    out_dir: Path = DEFAULT_OUT_DIR
    num_jobs: int = 2
    only: str | None = None
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.num_jobs < 1:
            raise ValueError(f"num_jobs must be >= 1, got {self.num_jobs}")
        if self.only is not None and not self.only.strip():
            raise ValueError("only must be a non-empty name fragment when given")

    @property
    def library_path(self) -> Path:
        return Path(self.out_dir) / LIBRARY_NAME


def default_library_path() -> Path:
    """Where `python -m tilevox.trt_plugins.build` puts the library (override with TILEVOX_KERNELS_LIB)."""
    env = os.environ.get("TILEVOX_KERNELS_LIB")
    return Path(env) if env else DEFAULT_OUT_DIR / LIBRARY_NAME


def find_nvcc() -> str:
    """Path of nvcc (PATH, then $CUDA_HOME/bin); raises BuildError with a one-line reason."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *_DEFAULT_CUDA_ROOTS):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    raise BuildError("nvcc not found: install the CUDA toolkit (>= 12.3, sm_90a) or put nvcc on PATH / set CUDA_HOME")


def find_cutlass_include_dirs() -> list[Path]:
    """The two CUTLASS include folders (include/, tools/util/include/); raises BuildError if absent."""
    candidates: list[Path] = []
    env = os.environ.get("CUTLASS_DIR")
    if env:
        candidates.append(Path(env))
    else:
        spec = importlib.util.find_spec("cutlass_library")  # the nvidia-cutlass wheel (header-only use)
        if spec is not None and spec.origin is not None:
            candidates.append(Path(spec.origin).resolve().parent / "source")
    for root in candidates:
        inc, util = root / "include", root / "tools" / "util" / "include"
        if (inc / "cutlass" / "cutlass.h").is_file() and (util / "cutlass" / "util" / "packed_stride.hpp").is_file():
            return [inc, util]
    where = f"CUTLASS_DIR={env} has no include/cutlass/cutlass.h" if env else "no CUTLASS_DIR and no cutlass_library"
    raise BuildError(
        f"CUTLASS headers not found ({where}): `pip install --no-deps nvidia-cutlass==4.2.0.0` or set CUTLASS_DIR"
    )


def list_sources(only: str | None = None) -> list[Path]:
    """All .cu translation units under csrc/ (sorted), optionally filtered by a stem fragment."""
    sources = sorted(CSRC_DIR.rglob("*.cu"))
    if only is not None:
        sources = [s for s in sources if only in s.stem]
        if not sources:
            raise BuildError(f"--only {only!r} matches no translation unit under {CSRC_DIR}")
    return sources


def _newest_header_mtime() -> float:
    headers = [p for ext in ("*.h", "*.cuh", "*.hpp", "*.inc") for p in CSRC_DIR.rglob(ext)]
    return max((p.stat().st_mtime for p in headers), default=0.0)


def _object_path(cfg: BuildConfig, src: Path) -> Path:
    rel = src.relative_to(CSRC_DIR).with_suffix(".o")
    return Path(cfg.out_dir) / "obj" / str(rel).replace(os.sep, "__")


def _compile(nvcc: str, includes: list[Path], src: Path, obj: Path, verbose: bool) -> None:
    cmd = [nvcc, *NVCC_FLAGS, *(f"-I{d}" for d in includes), "-c", str(src), "-o", str(obj)]
    if verbose:
        print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"nvcc failed on {src.relative_to(CSRC_DIR)}:\n{proc.stdout}{proc.stderr}")
    print(f"compiled {src.relative_to(CSRC_DIR)}", flush=True)


# An installed package's folder (site-packages) is often read-only for the user running the build.
_READ_ONLY_HINT = (
    f"write the library elsewhere: set TILEVOX_KERNELS_LIB=~/.cache/tilevox/{LIBRARY_NAME} (the build then "
    "writes into that folder and the runtime loads the library from there), or pass --out DIR and set "
    f"TILEVOX_KERNELS_LIB=DIR/{LIBRARY_NAME}"
)


def _check_writable(out_dir: Path) -> None:
    try:
        (out_dir / "obj").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create {out_dir / 'obj'}: {exc}; {_READ_ONLY_HINT}") from exc
    if not os.access(out_dir / "obj", os.W_OK):
        raise BuildError(f"{out_dir} is not writable; {_READ_ONLY_HINT}")


def build(cfg: BuildConfig) -> Path | None:
    """Compile (and unless cfg.only, link). Returns the library path, or None for a compile-only run."""
    _check_writable(Path(cfg.out_dir))
    nvcc = find_nvcc()
    includes = [*find_cutlass_include_dirs(), CSRC_DIR]
    sources = list_sources(cfg.only)
    header_mtime = _newest_header_mtime()
    todo = []
    for src in sources:
        obj = _object_path(cfg, src)
        if not obj.exists() or obj.stat().st_mtime < max(src.stat().st_mtime, header_mtime):
            todo.append((src, obj))
    with ThreadPoolExecutor(max_workers=cfg.num_jobs) as pool:
        # list() re-raises the first compile error.
        list(pool.map(lambda so: _compile(nvcc, includes, so[0], so[1], cfg.verbose), todo))
    if cfg.only is not None:
        return None
    lib = cfg.library_path
    objs = [str(_object_path(cfg, s)) for s in sources]
    cmd = [nvcc, "-shared", "-gencode", "arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC", *objs, "-o", str(lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"link failed:\n{proc.stdout}{proc.stderr}")
    print(f"built {lib}", flush=True)
    return lib


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tilevox.trt_plugins.build", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=default_library_path().parent,
        help="output folder (default: the folder of $TILEVOX_KERNELS_LIB if set, else %(default)s)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="parallel nvcc processes, ~3.3 GB RAM each")
    parser.add_argument("--only", default=None, help="compile only translation units whose name contains this; no link")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    try:
        cfg = BuildConfig(out_dir=args.out, num_jobs=args.jobs, only=args.only, verbose=args.verbose)
        build(cfg)
    except (BuildError, ValueError) as exc:
        print(f"trt_plugins.build: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
