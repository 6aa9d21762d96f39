"""The TensorRT IPluginV3 shims: registry consistency, the built library's creators, and the lean-runtime harness.

Building needs $TENSORRT_INCLUDE_DIR (TensorRT headers are not redistributed) and libtilevox_kernels.so; the
registry tests need the TensorRT lean runtime (`pip install tensorrt-lean-cu13-libs`, or $TILEVOX_TRT_LEAN_LIB).
Without them these tests skip and say which is missing. The `gpu` test runs enqueue and compares the plugin's
output with the torch op bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tilevox.trt_plugins.library import KernelLibraryNotFoundError, kernels_library, kernels_library_path
from tilevox.trt_plugins.ops import GateUpLayout, SwigluKernel, pack_gate_up
from tilevox.trt_plugins.registry import PLUGINS, PluginField, PluginSpec, plugin_for_op
from tilevox.trt_plugins.tensorrt import harness_library_path, plugin_library_path
from tilevox.trt_plugins.tensorrt.build import (
    PLUGIN_LIBRARY_NAME,
    TENSORRT_INCLUDE_ENV_VAR,
    PluginBuildConfig,
    PluginBuildError,
    build_plugins,
    find_cuda_include_dir,
)
from tilevox.trt_plugins.tensorrt.harness import describe_plugins, lean_library_path, run_plugin


def test_registry_entries_are_consistent():
    for op, spec in PLUGINS.items():
        assert spec.op == op and op == f"{spec.namespace}::{spec.name}"
        assert spec.field_names[:3] == ("kernel", "block", "tile_config")
    assert plugin_for_op("tilevox::swiglu_mlp").inputs == ("x", "w_packed", "w_down")
    with pytest.raises(ValueError, match="no TensorRT plugin"):
        plugin_for_op("tilevox::nope")
    with pytest.raises(ValueError, match="must equal the op name"):
        PluginSpec(op="tilevox::a", name="b", version="1", namespace="tilevox", inputs=(), fields=())
    with pytest.raises(ValueError, match="identifier"):
        PluginField(name="plugin_version", type=next(iter(PLUGINS.values())).fields[0].type, default=0)


@pytest.fixture(scope="module")
def plugin_libs(tmp_path_factory) -> tuple[Path, Path]:
    """(plugin library, harness library): freshly built when headers and kernels are here, else prebuilt ones."""
    include = os.environ.get(TENSORRT_INCLUDE_ENV_VAR)
    kernels = kernels_library_path()
    if include and kernels.is_file() and shutil.which("g++"):
        out = tmp_path_factory.mktemp("trt_plugins")
        (out / kernels.name).symlink_to(kernels.resolve())  # the plugin finds its kernel library by rpath $ORIGIN
        try:
            cfg = PluginBuildConfig(
                tensorrt_include_dir=Path(include),
                kernels_library=out / kernels.name,
                cuda_include_dir=find_cuda_include_dir(),
                out_dir=out,
            )
        except PluginBuildError as exc:
            pytest.skip(f"cannot build the TensorRT plugins here: {exc}")
        return build_plugins(cfg)
    plugin, harness = plugin_library_path(), harness_library_path()
    if plugin.is_file() and harness.is_file():
        return plugin, harness
    pytest.skip(
        f"no TensorRT plugin library: set ${TENSORRT_INCLUDE_ENV_VAR} to TensorRT headers and build "
        f"libtilevox_kernels.so ({kernels}), or provide a prebuilt {plugin}"
    )


@pytest.fixture(scope="module")
def lean_lib() -> Path:
    path = lean_library_path()
    if path is None or not path.is_file():
        pytest.skip(
            "the TensorRT lean runtime is absent: pip install tensorrt-lean-cu13-libs or set "
            "$TILEVOX_TRT_LEAN_LIB to libnvinfer_lean.so.11"
        )
    return path


def _packing_block() -> int:
    try:
        return kernels_library().tilevox_swiglu_packing_block()
    except KernelLibraryNotFoundError as exc:
        pytest.skip(f"needs libtilevox_kernels.so for its packing block: {exc}")


def test_plugin_library_exports_only_entry_points(plugin_libs):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils `nm` is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", str(plugin_libs[0])], capture_output=True, text=True, check=True)
    assert sorted(line.split()[-1] for line in out.stdout.splitlines() if line.strip()) == [
        "getCreators",
        "setLoggerFinder",
    ]
    assert plugin_libs[0].name == PLUGIN_LIBRARY_NAME


def test_creators_match_registry(plugin_libs):
    creators = describe_plugins(*plugin_libs)
    described = {c["name"]: c for c in creators}
    assert all(c["kind"] == "PLUGIN CREATOR_V3ONE" for c in creators)
    assert set(described) == {spec.name for spec in PLUGINS.values()}
    for spec in PLUGINS.values():
        c = described[spec.name]
        assert (c["version"], c["namespace"]) == (spec.version, spec.namespace)
        assert [tuple(f) for f in c["fields"]] == [(name, "kINT32") for name in spec.field_names]


@pytest.mark.parametrize("op", sorted(PLUGINS))
def test_lean_registry_builds_plugin_from_parser_fields(plugin_libs, lean_lib, op):
    # No CUDA needed: the lean library's global registry loads the plugin library; all but enqueue runs.
    block = _packing_block()
    m, n, k, hidden = 7, 2 * block * 4, 64, 48
    inputs = [torch.empty(1, m, k), torch.empty(2 * n, k)] + ([torch.empty(hidden, n)] if op.endswith("mlp") else [])
    fields = {"kernel": 2, "block": block, "tile_config": -1}
    result = run_plugin(
        op,
        inputs,
        fields,
        output=None,
        output_shape=(1, m, hidden if op.endswith("mlp") else n),
        lean_lib=lean_lib,
        plugin_lib=plugin_libs[0],
        harness_lib=plugin_libs[1],
        use_global_registry=True,
    )
    assert result.ok, result.report
    assert "PASS createPlugin(kRUNTIME) from the serialized fields" in result.report
    bad = run_plugin(
        op,
        inputs,
        {**fields, "block": block + 1},
        output=None,
        output_shape=(1, m, n if op.endswith("gateup") else hidden),
        lean_lib=lean_lib,
        plugin_lib=plugin_libs[0],
        harness_lib=plugin_libs[1],
        use_global_registry=True,
    )
    assert not bad.ok and "FAIL createPlugin(kBUILD)" in bad.report


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(PLUGINS))
@pytest.mark.parametrize("m", [1, 37, 512])
def test_plugin_enqueue_equals_torch_op_bitwise(plugin_libs, lean_lib, op, m):
    block = _packing_block()
    n, k, hidden = 1152, 896, 896
    g = torch.Generator().manual_seed(m)
    x = torch.randn(1, m, k, generator=g).to(torch.bfloat16).cuda()
    w_gate, w_up = ((torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16) for _ in range(2))
    w_down = (torch.randn(hidden, n, generator=g) / n**0.5).to(torch.bfloat16).cuda()
    is_mlp = op.endswith("mlp")
    for layout in (
        GateUpLayout(kernel=SwigluKernel.DUAL_PINGPONG, block=0),
        GateUpLayout(kernel=SwigluKernel.PACKED_EVT, block=block),
    ):
        packed = pack_gate_up(w_gate, w_up, kernel=layout.kernel, block=layout.block).cuda()
        for tile_config in range(-1, kernels_library().tilevox_swiglu_gateup_num_configs(int(layout.kernel))):
            args = (int(layout.kernel), layout.block, tile_config)
            expected = (
                torch.ops.tilevox.swiglu_mlp(x, packed, w_down, *args, -1)
                if is_mlp
                else torch.ops.tilevox.swiglu_gateup(x, packed, *args)
            )
            out = torch.full_like(expected, float("nan"))  # poisoned: an enqueue that writes nothing cannot pass
            workspace = torch.empty(m * n * 2 + 4096, dtype=torch.uint8, device="cuda")
            fields = dict(zip(("kernel", "block", "tile_config"), args))
            result = run_plugin(
                op,
                [x, packed] + ([w_down] if is_mlp else []),
                fields,
                output=out,
                output_shape=tuple(expected.shape),
                lean_lib=lean_lib,
                plugin_lib=plugin_libs[0],
                harness_lib=plugin_libs[1],
                workspace=workspace,
            )
            torch.cuda.synchronize()
            assert result.ok, result.report
            assert torch.equal(out, expected), f"{op} {args}: plugin output != torch op"
