"""The TensorRT IPluginV3 shims: registry consistency, the built library's creators, and the lean-runtime harness.

Building needs $TENSORRT_INCLUDE_DIR (TensorRT headers are not redistributed) and libtilevox_kernels.so; the
registry tests need the TensorRT lean runtime (`pip install tensorrt-lean-cu13-libs`, or $TILEVOX_TRT_LEAN_LIB).
Without them these tests skip and say which is missing. The `gpu` test runs enqueue and compares the plugin's
output with the torch op bit for bit. The MegakernelRegion tests build their own library (megakernel_region=True,
a fixture of their own, so the others keep the default library): its plugin, created from the fields of the
Llasa decoder_step node that engine_builder.onnx_lowering writes, must equal the torch op's launch of the same
program bit for bit on the GPU (logits, sampled tokens, KV caches, error words). The field tests without any of
these check the harness's fields against the plugin's C++ declarations.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tilevox.trt_plugins.library import KernelLibraryNotFoundError, kernels_library, kernels_library_path
from tilevox.trt_plugins.ops import GateUpLayout, SwigluKernel, pack_gate_up
from tilevox.trt_plugins.registry import PLUGINS, PluginField, PluginSpec, plugin_for_op
from tilevox.trt_plugins.tensorrt import harness, harness_library_path, plugin_library_path
from tilevox.trt_plugins.tensorrt.build import (
    MEGAKERNEL_REGION_SOURCE,
    PLUGIN_LIBRARY_NAME,
    TENSORRT_INCLUDE_ENV_VAR,
    PluginBuildConfig,
    PluginBuildError,
    build_plugins,
    find_cuda_include_dir,
)
from tilevox.trt_plugins.tensorrt.harness import (
    HarnessField,
    describe_plugins,
    lean_library_path,
    parser_fields,
    run_plugin,
    run_plugin_fields,
)


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


# --- MegakernelRegion ---------------------------------------------------------------------------------------------

_TENSORRT_DIR = Path(harness.__file__).resolve().parent
_REGION_BATCH = 2
_REGION_PLUGIN = ("MegakernelRegion", "1", "tilevox")  # creator name, version, namespace
_NOT_CREATOR_FIELDS = {"buffer_names", "plugin_version", "plugin_namespace"}  # node attributes the parser drops


def _cpp_field_table(source: str, table: str) -> list[tuple[str, str, int]]:
    """(name, PluginFieldType, length) of each PluginField(...) in the C++ array `table` of `source`."""
    body = re.search(rf"PluginField const {table}\[\] = \{{(.*?)\n\}};", source, re.S)
    assert body, f"no array {table} in the source"
    return [
        (name, kind, int(length))
        for name, kind, length in re.findall(
            r'PluginField\("(\w+)", nullptr, PluginFieldType::(k\w+), (\d+)\)', body.group(1)
        )
    ]


def _region_declared_fields() -> list[tuple[str, str, int]]:
    """MegakernelRegion's getFieldNames() as megakernel_region_plugin.cpp declares it (kFieldList)."""
    return _cpp_field_table((_TENSORRT_DIR / MEGAKERNEL_REGION_SOURCE).read_text(), "kFieldList")


def _onnx_modules():
    onnx = pytest.importorskip("onnx", reason="the MegakernelRegion node needs `onnx` (pip install onnx onnxscript)")
    pytest.importorskip("onnxscript", reason="trt_plugins.onnx needs `onnxscript`")
    return onnx


def _region_export(device: str):
    """(Llasa random:llama-tiny in bf16 on `device`, its decoder_step llama, the exported batch-2 megakernel
    model, its MegakernelRegion node, the CacheLayout), as `tilevox build --onnx` exports a bucket."""
    _onnx_modules()
    from tilevox.engine_builder.onnx_lowering import CacheLayout, export_decoder_step
    from tilevox.models.llasa.loader import load_preset
    from tilevox.models.region_backends import DECODER_STEP, region_module

    model = load_preset("llama-tiny", device=device, dtype=torch.bfloat16, max_streams=4, max_seq_len=64)
    cache = CacheLayout(num_slots=model.max_streams, cache_len=model.max_seq_len)  # as export_plan reads them
    llama = region_module(model, DECODER_STEP)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 132
    exported = export_decoder_step(llama, batch=_REGION_BATCH, cache=cache, megakernel=True, num_sms=num_sms)
    (node,) = exported.graph.node
    assert (node.domain, node.op_type) == (_REGION_PLUGIN[2], _REGION_PLUGIN[0])
    return llama, exported, node, cache, num_sms


def test_region_fields_match_the_plugin_declarations():
    """One list of field names in Python (ARRAY_FIELDS + SCALAR_FIELDS, from instructions.LAUNCH_PARAMS), three in
    the C++ plugin (kFieldList = getFieldNames, parseFields, getFieldsToSerialize): all must agree, and the
    fields the harness passes for the exported node (parser_fields) must have the declared names, types and
    the lengths the plugin's validation requires."""
    _onnx_modules()
    from tilevox.trt_plugins.megakernel.instructions import INSTRUCTION_WORDS
    from tilevox.trt_plugins.megakernel.packing import MAX_DIMS
    from tilevox.trt_plugins.onnx.megakernel_region import ARRAY_FIELDS, SCALAR_FIELDS

    source = (_TENSORRT_DIR / MEGAKERNEL_REGION_SOURCE).read_text()
    declared = _region_declared_fields()
    names = [name for name, _, _ in declared]
    assert len(names) == len(set(names))
    python = {name: ("kINT32", 0) for name in ARRAY_FIELDS} | {
        name: ("kFLOAT32" if kind == "float" else "kINT32", 1) for name, kind in SCALAR_FIELDS
    }
    assert {name: (kind, length) for name, kind, length in declared} == python
    parse = re.search(r"bool parseFields\(.*?\n\}\n", source, re.S).group(0)
    assert set(re.findall(r'name == "(\w+)"', parse)) == set(names)
    serialize = re.search(r"getFieldsToSerialize\(\) noexcept override \{(.*?)\n  \}\n", source, re.S).group(1)
    assert set(re.findall(r'(?:array|scalar|emplace_back)\("(\w+)"', serialize)) == set(names)
    assert "Dims::MAX_DIMS" in source and MAX_DIMS <= 8  # the plugin rejects ranks above TensorRT's 8

    node = _region_export("cpu")[2]
    assert {a.name for a in node.attribute} == set(names) | _NOT_CREATOR_FIELDS
    fields = {f.name: f for f in parser_fields(node, {name: kind for name, kind, _ in declared})}
    assert set(fields) == set(names)  # plugin_version, plugin_namespace, buffer_names are not passed
    for name, kind, length in declared:
        assert fields[name].type == kind, name
        assert length == 0 or len(fields[name].values) == length, name
    one = {name: fields[name].values[0] for name, _, length in declared if length == 1}
    assert len(fields["instructions"].values) == one["num_queues"] * one["max_queue_len"] * INSTRUCTION_WORDS
    assert len(fields["queue_lengths"].values) == one["num_queues"]
    assert len(fields["buffer_table"].values) == one["num_buffers"] * (3 + MAX_DIMS)
    assert len(fields["input_buffers"].values) == len(node.input)
    assert len(fields["output_buffers"].values) == len(node.output) - 1  # the node's last output: the error words
    assert one["batch_size"] == _REGION_BATCH


def _c_struct_fields(source: str, struct: str) -> list[str]:
    body = re.search(rf"typedef struct {struct} \{{(.*?)\}} {struct};", source, re.S)
    assert body, f"no struct {struct} in lean_harness.cpp"
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", body.group(1), flags=re.S)
    return [re.search(r"(\w+)(?:\[\d+\])?$", decl.strip()).group(1) for decl in text.split(";") if decl.strip()]


@pytest.mark.parametrize(
    "struct,mirror",
    [
        ("tilevox_harness_case", harness._HarnessCase),
        ("tilevox_harness_field", harness._Field),
        ("tilevox_harness_tensor", harness._Tensor),
        ("tilevox_harness_plugin_case", harness._PluginCase),
    ],
)
def test_harness_ctypes_mirror_the_c_structs(struct, mirror):
    source = (_TENSORRT_DIR / "lean_harness.cpp").read_text()
    assert [name for name, *_ in mirror._fields_] == _c_struct_fields(source, struct)


def test_harness_fields_refuse_values_outside_their_type():
    assert HarnessField("a", "kINT32", (2**31 - 1, -(2**31))).as_array()[0] == 2**31 - 1
    with pytest.raises(ValueError, match="outside kINT32"):
        HarnessField("a", "kINT32", (2**31,))
    with pytest.raises(ValueError, match="non-integers"):
        HarnessField("a", "kINT64", (1.5,))
    with pytest.raises(ValueError, match="not one of"):
        HarnessField("a", "kDIMS", ())


@pytest.fixture(scope="module")
def region_plugin_libs(tmp_path_factory) -> tuple[Path, Path]:
    """(plugin library with MegakernelRegion, harness library), built here with megakernel_region=True."""
    include = os.environ.get(TENSORRT_INCLUDE_ENV_VAR)
    kernels = kernels_library_path()
    if not include or not kernels.is_file() or not shutil.which("g++"):
        pytest.skip(
            f"cannot build the MegakernelRegion plugin: needs ${TENSORRT_INCLUDE_ENV_VAR} (TensorRT headers; set: "
            f"{bool(include)}), libtilevox_kernels.so ({kernels}; present: {kernels.is_file()}) and g++"
        )
    out = tmp_path_factory.mktemp("trt_plugins_region")
    (out / kernels.name).symlink_to(kernels.resolve())  # the plugin finds its kernel library by rpath $ORIGIN
    try:
        cfg = PluginBuildConfig(
            tensorrt_include_dir=Path(include),
            kernels_library=out / kernels.name,
            cuda_include_dir=find_cuda_include_dir(),
            out_dir=out,
            megakernel_region=True,
        )
    except PluginBuildError as exc:
        pytest.skip(f"cannot build the MegakernelRegion plugin here: {exc}")
    return build_plugins(cfg)  # a compile or link error fails the tests that use it


def _declared(region_plugin_libs) -> dict[str, str]:
    """The built creator's getFieldNames(), name -> PluginFieldType, which must be the source's kFieldList."""
    (creator,) = [c for c in describe_plugins(*region_plugin_libs) if c.get("name") == _REGION_PLUGIN[0]]
    assert (creator["version"], creator["namespace"]) == _REGION_PLUGIN[1:]
    assert [tuple(f) for f in creator["fields"]] == [(n, k) for n, k, _ in _region_declared_fields()]
    return dict(map(tuple, creator["fields"]))


def _meta(specs) -> list[torch.Tensor]:
    from tilevox.trt_plugins.megakernel.vm import TORCH_DTYPES

    return [torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype], device="meta") for spec in specs]


@pytest.mark.parametrize("int_type", ["kINT32", "kINT64"])
def test_lean_registry_builds_region_plugin_from_node_fields(region_plugin_libs, lean_lib, int_type):
    # No CUDA needed: the global registry; every step but enqueue. kINT32: the ONNX parser; kINT64: API callers.
    from tilevox.trt_plugins.megakernel.instructions import ERROR_WORDS
    from tilevox.trt_plugins.onnx.megakernel_region import node_io_buffers, program_from_attributes

    onnx = _onnx_modules()
    node = _region_export("cpu")[2]
    program = program_from_attributes({a.name: onnx.helper.get_attribute_value(a) for a in node.attribute})
    in_specs, out_specs = node_io_buffers(program)
    inputs = _meta(in_specs)
    outputs = [*_meta(out_specs), torch.empty(ERROR_WORDS, dtype=torch.int32, device="meta")]
    fields = parser_fields(node, _declared(region_plugin_libs), int_type=int_type)
    run = dict(
        lean_lib=lean_lib,
        plugin_lib=region_plugin_libs[0],
        harness_lib=region_plugin_libs[1],
        enqueue_count=0,
        use_global_registry=True,
    )
    result = run_plugin_fields(_REGION_PLUGIN, fields, inputs, outputs, reject_position=len(inputs) + 1, **run)
    assert result.ok, result.report
    assert "PASS createPlugin(kRUNTIME) from the serialized fields" in result.report
    assert result.workspace_bytes > 0
    truncated = [dataclasses.replace(f, values=f.values[:-1]) if f.name == "instructions" else f for f in fields]
    bad = run_plugin_fields(_REGION_PLUGIN, truncated, inputs, outputs, **run)
    assert not bad.ok and "FAIL createPlugin(kBUILD)" in bad.report


def _initializer(tensor) -> torch.Tensor:
    """An ONNX initializer as a CPU torch tensor, bytes unchanged (bf16 through its raw bits)."""
    import onnx

    if tensor.data_type == onnx.TensorProto.BFLOAT16:
        raw = bytearray(tensor.raw_data)
        return torch.frombuffer(raw, dtype=torch.bfloat16).reshape(tuple(tensor.dims)).clone()
    return torch.from_numpy(onnx.numpy_helper.to_array(tensor).copy())


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    fill = float("nan") if like.dtype.is_floating_point else torch.iinfo(like.dtype).min
    return torch.full_like(like, fill)


@pytest.mark.gpu
@pytest.mark.requires_megakernel
@pytest.mark.parametrize("state", ["copied", "in_place"])
def test_region_plugin_enqueue_equals_torch_op_bitwise(region_plugin_libs, lean_lib, state):
    """The decoder_step node's plugin, created from the node's fields through the lean runtime's registry and
    enqueued (twice on one attached plugin when the state is copied: the second reuses the uploaded program
    and pointer table), equals launch_op of the same compiled program on copies of the same inputs."""
    from tilevox.engine_builder.regions.compiler import compile_region
    from tilevox.engine_builder.regions.spec import region_spec
    from tilevox.executor.megakernel_inputs import sampling_inputs
    from tilevox.models.region_backends import DECODER_STEP
    from tilevox.models.sampling import SamplingParams
    from tilevox.trt_plugins.megakernel.instructions import ERROR_WORDS
    from tilevox.trt_plugins.megakernel.runtime import CudaProgram
    from tilevox.trt_plugins.megakernel.torch_op import launch_op
    from tilevox.trt_plugins.onnx.megakernel_region import node_io_buffers

    llama, exported, node, cache, num_sms = _region_export("cuda")
    # torch side: the program compiled as the megakernel backend and onnx_lowering compile it
    region = compile_region(
        llama,
        region_spec(DECODER_STEP),
        batch_size=_REGION_BATCH,
        max_context=cache.cache_len,
        num_cache_slots=cache.num_slots,
        cache_len=cache.cache_len,
        num_sms=num_sms,
    )
    in_specs, out_specs = node_io_buffers(region.program)
    gen = torch.Generator().manual_seed(14)
    shape = next(spec.shape for spec in in_specs if spec.name == "k_cache")  # (layers, slots, kv heads, T, D)
    feeds = {  # the graph inputs; rows at different positions in different slots
        "tokens": torch.tensor([7, 93]),
        "positions": torch.tensor([5, 2]),
        "slots": torch.tensor([3, 1]),
        "k_cache": torch.randn(shape, generator=gen).to(torch.bfloat16),
        "v_cache": torch.randn(shape, generator=gen).to(torch.bfloat16),
    }
    feeds = {name: t.cuda() for name, t in feeds.items()}
    greedy = sampling_inputs([SamplingParams.greedy()] * _REGION_BATCH, seeds=[0] * _REGION_BATCH)
    bound = {
        **{name: t.to("cuda").contiguous() for name, t in region.weights.items()},
        **{name: t.cuda() for name, t in greedy.items()},
        **{name: t.clone() for name, t in feeds.items()},
    }
    launch = CudaProgram(region.program).bind(bound)
    expected = {name: t.clone() for name, t in launch_op(launch, check=True).items()}
    expected_error = launch.error.clone()

    # plugin side: the node's inputs (initializers and graph inputs) on copies, poisoned outputs
    initializers = {t.name: t for t in exported.graph.initializer}
    inputs = [
        feeds[name].clone() if name in feeds else _initializer(initializers[name]).cuda().contiguous()
        for name in node.input
    ]
    assert [tuple(t.shape) for t in inputs] == [spec.shape for spec in in_specs]
    by_name = {spec.name: t for spec, t in zip(in_specs, inputs)}
    for spec in in_specs:  # the node carries the very weights and sampling inputs the torch side binds
        if spec.name not in feeds:
            assert torch.equal(by_name[spec.name], bound[spec.name]), spec.name
    originals = {name: by_name[name].clone() for name in ("k_cache", "v_cache")}
    outputs = [
        by_name[spec.name] if state == "in_place" and spec.name in originals else _poisoned(expected[spec.name])
        for spec in out_specs
    ]
    error = torch.full((ERROR_WORDS,), -1, dtype=torch.int32, device="cuda")  # the launcher must zero it
    enqueues = 2 if state == "copied" else 1
    result = run_plugin_fields(
        _REGION_PLUGIN,
        parser_fields(node, _declared(region_plugin_libs)),
        inputs,
        [*outputs, error],
        lean_lib=lean_lib,
        plugin_lib=region_plugin_libs[0],
        harness_lib=region_plugin_libs[1],
        enqueue_count=enqueues,
        reject_position=len(inputs) + len(outputs),  # the error words are int32 only
    )
    torch.cuda.synchronize()
    assert result.ok, result.report
    assert f"PASS enqueue {enqueues} of {enqueues} returned 0" in result.report
    for spec, got in zip(out_specs, outputs):
        assert torch.equal(got, expected[spec.name]), f"{spec.name}: plugin output != torch op ({state})"
    assert torch.equal(error, expected_error) and not error.any(), error.tolist()
    if state == "copied":  # functional: the state inputs are left as they were
        for name, original in originals.items():
            assert torch.equal(by_name[name], original), name
