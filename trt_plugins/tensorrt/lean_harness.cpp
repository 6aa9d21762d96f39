/*
 * lean_harness.cpp: libtilevox_lean_harness.so, a test harness that drives a tilevox plugin the way TensorRT does.
 *
 * tilevox_harness_run() dlopens the TensorRT lean runtime (libnvinfer_lean.so.11, from the
 * tensorrt-lean-cu13-libs wheel), loads the plugin library through the runtime's plugin registry, finds the
 * creator by (name, version, namespace), creates the plugin from parser-style kINT32 fields, runs the build
 * capability queries, round-trips the serialized fields into a runtime-phase plugin, attaches it, and calls
 * onShapeChange + enqueue on caller-owned device buffers (the Python test passes torch tensors and compares the
 * output with the torch op). tilevox_harness_describe() lists a plugin library's creators without TensorRT.
 * tilevox_harness_run_plugin() is the general form (the MegakernelRegion plugin needs it): fields of any
 * kINT32 / kINT64 / kFLOAT32 ... type and length, several inputs and outputs of their own DataTypes, a
 * workspace whose required size it reports, several enqueues on one attached plugin, and a stream
 * synchronization (cuStreamSynchronize of the already loaded CUDA driver) before the plugins are destroyed.
 * Needs the TensorRT headers only; links no TensorRT or CUDA library.
 */
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "NvInferRuntime.h"

using namespace nvinfer1;

namespace {

constexpr char const* kV3OneKind = "PLUGIN CREATOR_V3ONE";

class CollectingLogger : public ILogger {
 public:
  void log(Severity severity, AsciiChar const* msg) noexcept override {
    if (severity <= Severity::kERROR) errored = true;
    if (severity <= Severity::kWARNING) messages << "[trt " << static_cast<int>(severity) << "] " << msg << "\n";
  }
  std::ostringstream messages;
  bool errored = false;
};

char const* typeName(PluginFieldType type) {
  switch (type) {
    case PluginFieldType::kINT32: return "kINT32";
    case PluginFieldType::kINT64: return "kINT64";
    case PluginFieldType::kFLOAT32: return "kFLOAT32";
    case PluginFieldType::kCHAR: return "kCHAR";
    case PluginFieldType::kUNKNOWN: return "kUNKNOWN";
    default: return "other";
  }
}

void copyOut(std::string const& text, char* out, int32_t outLen) {
  if (out == nullptr || outLen <= 0) return;
  std::size_t const n = text.size() < static_cast<std::size_t>(outLen - 1) ? text.size() : outLen - 1;
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

Dims makeDims(int64_t const* d, int32_t nbDims) {
  Dims dims{};
  dims.nbDims = nbDims;
  for (int32_t i = 0; i < nbDims; ++i) dims.d[i] = d[i];
  return dims;
}

/* DataTypes by their enumerator names (the Python side passes names, so no enum value is retyped there). */
struct NamedDataType {
  char const* name;
  DataType type;
};
constexpr NamedDataType kDataTypes[] = {
    {"kFLOAT", DataType::kFLOAT}, {"kHALF", DataType::kHALF},   {"kINT8", DataType::kINT8},
    {"kINT32", DataType::kINT32}, {"kBOOL", DataType::kBOOL},   {"kUINT8", DataType::kUINT8},
    {"kBF16", DataType::kBF16},   {"kINT64", DataType::kINT64}, {"kFP8", DataType::kFP8},
};

bool parseDataType(char const* name, DataType& out) {
  for (NamedDataType const& t : kDataTypes) {
    if (name != nullptr && std::strcmp(name, t.name) == 0) {
      out = t.type;
      return true;
    }
  }
  return false;
}

char const* dataTypeName(DataType type) {
  for (NamedDataType const& t : kDataTypes) {
    if (t.type == type) return t.name;
  }
  return "other";
}

struct NamedFieldType {
  char const* name;
  PluginFieldType type;
  int32_t bytes;  // per element; 0 = not supported by the harness
};
constexpr NamedFieldType kFieldTypes[] = {
    {"kFLOAT16", PluginFieldType::kFLOAT16, 2}, {"kFLOAT32", PluginFieldType::kFLOAT32, 4},
    {"kFLOAT64", PluginFieldType::kFLOAT64, 8}, {"kINT8", PluginFieldType::kINT8, 1},
    {"kINT16", PluginFieldType::kINT16, 2},     {"kINT32", PluginFieldType::kINT32, 4},
    {"kCHAR", PluginFieldType::kCHAR, 1},       {"kBF16", PluginFieldType::kBF16, 2},
    {"kINT64", PluginFieldType::kINT64, 8},
};

bool parseFieldType(char const* name, PluginFieldType& out) {
  for (NamedFieldType const& t : kFieldTypes) {
    if (name != nullptr && std::strcmp(name, t.name) == 0) {
      out = t.type;
      return true;
    }
  }
  return false;
}

int32_t fieldElementBytes(PluginFieldType type) {
  for (NamedFieldType const& t : kFieldTypes) {
    if (t.type == type) return t.bytes;
  }
  return 0;
}

/* Element i of an integer or floating field, widened (int64 / double): false for other types. */
bool fieldElement(PluginField const& f, int32_t i, bool& isFloat, int64_t& iv, double& fv) {
  isFloat = false;
  switch (f.type) {
    case PluginFieldType::kINT8: iv = static_cast<int8_t const*>(f.data)[i]; return true;
    case PluginFieldType::kINT16: iv = static_cast<int16_t const*>(f.data)[i]; return true;
    case PluginFieldType::kINT32: iv = static_cast<int32_t const*>(f.data)[i]; return true;
    case PluginFieldType::kINT64: iv = static_cast<int64_t const*>(f.data)[i]; return true;
    case PluginFieldType::kCHAR: iv = static_cast<char const*>(f.data)[i]; return true;
    case PluginFieldType::kFLOAT32: isFloat = true; fv = static_cast<float const*>(f.data)[i]; return true;
    case PluginFieldType::kFLOAT64: isFloat = true; fv = static_cast<double const*>(f.data)[i]; return true;
    default: return false;
  }
}

/* Same length and, element by element, the same number (an int32 field equals an int64 field of equal values;
 * floats compare exactly, so a kFLOAT32 value survives the round trip only unchanged). */
bool sameFieldValues(PluginField const& a, PluginField const& b) {
  if (a.length != b.length) return false;
  for (int32_t i = 0; i < a.length; ++i) {
    bool af = false, bf = false;
    int64_t ai = 0, bi = 0;
    double ad = 0.0, bd = 0.0;
    if (!fieldElement(a, i, af, ai, ad) || !fieldElement(b, i, bf, bi, bd) || af != bf) return false;
    if (af ? ad != bd : ai != bi) return false;
  }
  return true;
}

/* A deep copy of a PluginFieldCollection (what a plan stores: names and bytes), owning its storage. */
class OwnedFields {
 public:
  bool copy(PluginFieldCollection const* fc, std::string& why) {
    names_.clear();
    bytes_.clear();
    fields_.clear();
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
      PluginField const& f = fc->fields[i];
      int32_t const size = fieldElementBytes(f.type);
      if (f.name == nullptr || size == 0 || f.length < 0 || (f.length > 0 && f.data == nullptr)) {
        why = std::string("serialized field ") + std::to_string(i) + " (" + (f.name ? f.name : "null") +
              ") has a null name or data, a negative length or a type the harness cannot copy";
        return false;
      }
      names_.emplace_back(f.name);
      char const* src = static_cast<char const*>(f.data);
      bytes_.emplace_back(src, src + static_cast<std::size_t>(f.length) * size);
    }
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {  // pointers into the filled vectors only
      PluginField const& f = fc->fields[i];
      fields_.emplace_back(names_[i].c_str(), bytes_[i].empty() ? nullptr : bytes_[i].data(), f.type, f.length);
    }
    collection_.nbFields = static_cast<int32_t>(fields_.size());
    collection_.fields = fields_.data();
    return true;
  }
  PluginFieldCollection const* collection() const { return &collection_; }
  std::vector<PluginField> const& fields() const { return fields_; }

 private:
  std::vector<std::string> names_;
  std::vector<std::vector<char>> bytes_;
  std::vector<PluginField> fields_;
  PluginFieldCollection collection_{0, nullptr};
};

bool declares(PluginFieldCollection const* declared, char const* name) {
  for (int32_t i = 0; declared != nullptr && i < declared->nbFields; ++i) {
    if (declared->fields[i].name != nullptr && std::strcmp(declared->fields[i].name, name) == 0) return true;
  }
  return false;
}

/* cuStreamSynchronize of the CUDA driver the caller (torch) already loaded; an error code or -1 if absent. */
int32_t synchronizeStream(void* stream, std::string& detail) {
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (cuda == nullptr) cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (cuda == nullptr) {
    detail = std::string("cannot dlopen libcuda.so.1: ") + dlerror();
    return -1;
  }
  using StreamSync = int (*)(void*);  // CUresult cuStreamSynchronize(CUstream)
  auto sync = reinterpret_cast<StreamSync>(dlsym(cuda, "cuStreamSynchronize"));
  if (sync == nullptr) {
    detail = "libcuda.so.1 has no cuStreamSynchronize";
    return -1;
  }
  int const status = sync(stream);
  detail = "CUresult " + std::to_string(status);
  return status;
}

/* The TensorRT side both harness entry points share: the lean runtime dlopened, a plugin registry (the
 * library-global one or an IRuntime's), the plugin library loaded into it and the creator looked up by
 * (name, version, namespace). */
struct LeanRegistry {
  IRuntime* runtime = nullptr;  // null with the global registry; the caller deletes it after deregisterLibrary
  IPluginRegistry* registry = nullptr;
  IPluginRegistry::PluginLibraryHandle libHandle = nullptr;
  IPluginCreatorInterface* creator = nullptr;  // may be null: the caller checks it
  CollectingLogger* reportLogger = nullptr;    // on failure, the logger whose messages the report carries (or null)
};

/* Every step is a `check` (PASS/FAIL line of `log`); `logger` is the caller's process-lifetime logger, reset here.
 * Returns true when the plugin library is loaded (the wrong-namespace lookup is only checked, a null `creator` is
 * left to the caller); false after a failed step, with nothing left to release and `out.reportLogger` set.
 * logVersions: also log the headers' and the lean library's TensorRT versions before loading the library. */
template <typename Check>
bool openLeanRegistry(char const* leanLib, char const* pluginLib, char const* name, char const* version,
                      char const* pluginNamespace, bool useGlobalRegistry, bool logVersions, CollectingLogger& logger,
                      std::ostringstream& log, Check& check, LeanRegistry& out) {
  out = LeanRegistry{};
  void* lean = dlopen(leanLib, RTLD_NOW | RTLD_GLOBAL);
  if (!check(lean != nullptr, std::string("dlopen lean runtime ") + leanLib)) {
    log << dlerror() << "\n";
    return false;
  }
  logger.messages.str("");
  logger.errored = false;
  IRuntime* runtime = nullptr;
  IPluginRegistry* registryPtr = nullptr;
  if (useGlobalRegistry) {
    using GetRegistry = IPluginRegistry* (*)();
    auto getRegistry = reinterpret_cast<GetRegistry>(dlsym(lean, "getPluginRegistry"));
    registryPtr = getRegistry != nullptr ? getRegistry() : nullptr;
    if (!check(registryPtr != nullptr, "lean library's global getPluginRegistry()")) {
      out.reportLogger = &logger;
      return false;
    }
  } else {
    using CreateRuntime = void* (*)(void*, int32_t);
    auto createRuntime = reinterpret_cast<CreateRuntime>(dlsym(lean, "createInferRuntime_INTERNAL"));
    if (!check(createRuntime != nullptr, "lean runtime exports createInferRuntime_INTERNAL")) return false;
    void* created = createRuntime(&logger, NV_TENSORRT_VERSION);
    // Without a usable CUDA driver the lean library logs an error and returns an unusable pointer: trust the log.
    if (!check(created != nullptr && !logger.errored, "createInferRuntime")) {
      out.reportLogger = &logger;
      return false;
    }
    runtime = static_cast<IRuntime*>(created);
    registryPtr = &runtime->getPluginRegistry();
  }
  if (logVersions) {
    using LibVersion = int32_t (*)();
    if (auto v = reinterpret_cast<LibVersion>(dlsym(lean, "getInferLibMajorVersion"))) {
      auto minor = reinterpret_cast<LibVersion>(dlsym(lean, "getInferLibMinorVersion"));
      log << "INFO headers " << NV_TENSORRT_MAJOR << "." << NV_TENSORRT_MINOR << ", lean library " << v() << "."
          << (minor ? minor() : -1) << "\n";
    }
  }

  IPluginRegistry& registry = *registryPtr;
  IPluginRegistry::PluginLibraryHandle libHandle = registry.loadLibrary(pluginLib);
  if (!check(libHandle != nullptr, std::string("registry.loadLibrary ") + pluginLib)) {
    delete runtime;
    out.reportLogger = &logger;
    return false;
  }
  check(registry.getCreator(name, version, "no_such_namespace") == nullptr,
        "lookup with a wrong namespace finds nothing");
  out.runtime = runtime;
  out.registry = registryPtr;
  out.libHandle = libHandle;
  out.creator = registry.getCreator(name, version, pluginNamespace);
  return true;
}

}  // namespace

extern "C" {

/* One harness case; pointers are device pointers except the descriptors. Mirrored in tests/trt_plugins. */
typedef struct tilevox_harness_case {
  char const* lean_lib;
  char const* plugin_lib;
  char const* plugin_name;
  char const* plugin_version;
  char const* plugin_namespace;
  int32_t nb_fields;
  char const* const* field_names;
  int32_t const* field_values;
  int32_t nb_inputs;
  void const* const* inputs;
  int64_t const* input_dims; /* nb_inputs x 8, row i holds input i's dims */
  int32_t const* input_nb_dims;
  void* output;
  int64_t const* output_dims; /* 8 */
  int32_t output_nb_dims;
  void* workspace;
  int64_t workspace_bytes;
  void* stream;
  /* 1: use the library-global registry (getPluginRegistry), which needs no CUDA; 0: an IRuntime's registry. */
  int32_t use_global_registry;
} tilevox_harness_case;

__attribute__((visibility("default"))) int32_t tilevox_harness_describe(char const* pluginLib, char* out,
                                                                         int32_t outLen) {
  void* handle = dlopen(pluginLib, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    copyOut(std::string("dlopen failed: ") + dlerror(), out, outLen);
    return 1;
  }
  using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);
  auto getCreators = reinterpret_cast<GetCreators>(dlsym(handle, "getCreators"));
  if (getCreators == nullptr || dlsym(handle, "setLoggerFinder") == nullptr) {
    copyOut("the library does not export getCreators and setLoggerFinder", out, outLen);
    return 1;
  }
  int32_t nb = 0;
  IPluginCreatorInterface* const* creators = getCreators(nb);
  std::ostringstream json;
  json << "[";
  for (int32_t i = 0; i < nb; ++i) {
    json << (i ? "," : "") << "{\"kind\":\"" << creators[i]->getInterfaceInfo().kind << "\"";
    if (std::strcmp(creators[i]->getInterfaceInfo().kind, kV3OneKind) == 0) {
      auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
      json << ",\"name\":\"" << c->getPluginName() << "\",\"version\":\"" << c->getPluginVersion()
           << "\",\"namespace\":\"" << c->getPluginNamespace() << "\",\"fields\":[";
      PluginFieldCollection const* fc = c->getFieldNames();
      for (int32_t f = 0; fc != nullptr && f < fc->nbFields; ++f) {
        json << (f ? "," : "") << "[\"" << fc->fields[f].name << "\",\"" << typeName(fc->fields[f].type) << "\"]";
      }
      json << "]";
    }
    json << "}";
  }
  json << "]";
  copyOut(json.str(), out, outLen);
  return 0;  // the library stays loaded: its creators are static objects other code may still hold
}

__attribute__((visibility("default"))) int32_t tilevox_harness_run(tilevox_harness_case const* c, char* report,
                                                                    int32_t reportLen) {
  std::ostringstream log;
  int32_t failures = 0;
  auto check = [&](bool ok, std::string const& what) {
    log << (ok ? "PASS " : "FAIL ") << what << "\n";
    if (!ok) ++failures;
    return ok;
  };
  auto finish = [&](CollectingLogger* logger) {
    if (logger != nullptr) log << logger->messages.str();
    copyOut(log.str(), report, reportLen);
    return failures == 0 ? 0 : 1;
  };

  static CollectingLogger logger;  // TensorRT keeps the logger for the process lifetime
  LeanRegistry lean;
  if (!openLeanRegistry(c->lean_lib, c->plugin_lib, c->plugin_name, c->plugin_version, c->plugin_namespace,
                        c->use_global_registry != 0, /*logVersions=*/true, logger, log, check, lean)) {
    return finish(lean.reportLogger);
  }
  IRuntime* runtime = lean.runtime;
  IPluginRegistry& registry = *lean.registry;
  IPluginRegistry::PluginLibraryHandle libHandle = lean.libHandle;
  IPluginCreatorInterface* iface = lean.creator;
  IPluginV3* buildPlugin = nullptr;
  IPluginV3* runtimePlugin = nullptr;
  IPluginV3* attached = nullptr;
  do {
    if (!check(iface != nullptr, std::string("getCreator(") + c->plugin_name + ", " + c->plugin_version + ", " +
                                     c->plugin_namespace + ")")) break;
    if (!check(std::strcmp(iface->getInterfaceInfo().kind, kV3OneKind) == 0, "creator is IPluginCreatorV3One")) break;
    auto* creator = static_cast<IPluginCreatorV3One*>(iface);

    // Fields as the ONNX parser builds them from INT attributes: kINT32, one element each.
    std::vector<PluginField> fields;
    for (int32_t i = 0; i < c->nb_fields; ++i) {
      fields.emplace_back(c->field_names[i], &c->field_values[i], PluginFieldType::kINT32, 1);
    }
    PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
    buildPlugin = creator->createPlugin(c->plugin_name, &fc, TensorRTPhase::kBUILD);
    if (!check(buildPlugin != nullptr, "createPlugin(kBUILD) from kINT32 fields")) break;

    auto* core = static_cast<IPluginV3OneCore*>(buildPlugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(buildPlugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    if (!check(core != nullptr && build != nullptr, "core and build capabilities")) break;
    check(std::strcmp(core->getPluginName(), c->plugin_name) == 0 &&
              std::strcmp(core->getPluginVersion(), c->plugin_version) == 0 &&
              std::strcmp(core->getPluginNamespace(), c->plugin_namespace) == 0,
          "core name/version/namespace match the creator");
    check(build->getNbOutputs() == 1, "getNbOutputs == 1");

    int32_t const nbIn = c->nb_inputs;
    std::vector<DataType> inTypes(nbIn, DataType::kBF16);
    DataType outType = DataType::kFLOAT;
    check(build->getOutputDataTypes(&outType, 1, inTypes.data(), nbIn) == 0 && outType == DataType::kBF16,
          "getOutputDataTypes bf16 -> bf16");

    std::vector<DynamicPluginTensorDesc> desc(nbIn + 1);
    for (int32_t i = 0; i <= nbIn; ++i) {
      Dims const dims = i < nbIn ? makeDims(c->input_dims + 8 * i, c->input_nb_dims[i])
                                 : makeDims(c->output_dims, c->output_nb_dims);
      desc[i].desc.dims = dims;
      desc[i].desc.type = DataType::kBF16;
      desc[i].desc.format = TensorFormat::kLINEAR;
      desc[i].desc.scale = 1.0F;
      desc[i].min = desc[i].opt = desc[i].max = dims;
    }
    bool allBf16 = true;
    for (int32_t pos = 0; pos <= nbIn; ++pos) allBf16 &= build->supportsFormatCombination(pos, desc.data(), nbIn, 1);
    check(allBf16, "supportsFormatCombination accepts linear bf16 everywhere");
    std::vector<DynamicPluginTensorDesc> fp32Desc = desc;
    fp32Desc[0].desc.type = DataType::kFLOAT;
    check(!build->supportsFormatCombination(0, fp32Desc.data(), nbIn, 1), "supportsFormatCombination rejects fp32 x");
    check(build->configurePlugin(desc.data(), nbIn, desc.data() + nbIn, 1) == 0, "configurePlugin");
    std::size_t const ws = build->getWorkspaceSize(desc.data(), nbIn, desc.data() + nbIn, 1);
    log << "INFO workspace bytes " << ws << "\n";
    // Only an enqueue needs the buffer; the registry-only (CPU) mode passes none.
    if (c->output != nullptr &&
        !check(static_cast<int64_t>(ws) <= c->workspace_bytes, "workspace fits the caller's buffer")) break;

    // Serialization round trip: what getFieldsToSerialize returns is all a plan stores.
    auto* buildRt = static_cast<IPluginV3OneRuntime*>(buildPlugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    if (!check(buildRt != nullptr, "build-phase object has the runtime capability")) break;
    PluginFieldCollection const* ser = buildRt->getFieldsToSerialize();
    if (!check(ser != nullptr && ser->nbFields >= c->nb_fields, "getFieldsToSerialize")) break;
    std::vector<int32_t> serValues(ser->nbFields);
    std::vector<std::string> serNames(ser->nbFields);
    std::vector<PluginField> serFields;
    bool serOk = true;
    for (int32_t i = 0; i < ser->nbFields; ++i) {
      serOk &= ser->fields[i].type == PluginFieldType::kINT32 && ser->fields[i].length == 1;
      serValues[i] = *static_cast<int32_t const*>(ser->fields[i].data);
      serNames[i] = ser->fields[i].name;
      for (int32_t j = 0; j < c->nb_fields; ++j) {
        if (serNames[i] == c->field_names[j]) serOk &= serValues[i] == c->field_values[j];
      }
    }
    check(serOk, "serialized fields are kINT32 and carry the given values");
    for (int32_t i = 0; i < ser->nbFields; ++i) {
      serFields.emplace_back(serNames[i].c_str(), &serValues[i], PluginFieldType::kINT32, 1);
    }
    PluginFieldCollection serFc{static_cast<int32_t>(serFields.size()), serFields.data()};
    runtimePlugin = creator->createPlugin(c->plugin_name, &serFc, TensorRTPhase::kRUNTIME);
    if (!check(runtimePlugin != nullptr, "createPlugin(kRUNTIME) from the serialized fields")) break;
    auto* rt0 = static_cast<IPluginV3OneRuntime*>(runtimePlugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    if (!check(rt0 != nullptr, "runtime capability")) break;
    attached = rt0->attachToContext(nullptr);
    if (!check(attached != nullptr, "attachToContext")) break;
    auto* rt = static_cast<IPluginV3OneRuntime*>(attached->getCapabilityInterface(PluginCapabilityType::kRUNTIME));

    std::vector<PluginTensorDesc> td(nbIn + 1);
    for (int32_t i = 0; i <= nbIn; ++i) td[i] = desc[i].desc;
    if (!check(rt->onShapeChange(td.data(), nbIn, td.data() + nbIn, 1) == 0, "onShapeChange")) break;
    if (c->output == nullptr) {
      log << "SKIP enqueue: no output buffer given\n";
      break;
    }
    void* outputs[1] = {c->output};
    int32_t const status = rt->enqueue(td.data(), td.data() + nbIn, c->inputs, outputs, c->workspace,
                                       static_cast<cudaStream_t>(c->stream));
    check(status == 0, "enqueue returned 0");
  } while (false);

  delete attached;
  delete runtimePlugin;
  delete buildPlugin;
  registry.deregisterLibrary(libHandle);
  delete runtime;
  return finish(&logger);
}

/* The general case (tilevox_harness_run_plugin). Mirrored in trt_plugins/tensorrt/harness.py. */
typedef struct tilevox_harness_field {
  char const* name;
  char const* type; /* a PluginFieldType enumerator name: "kINT32", "kINT64", "kFLOAT32", ... */
  void const* data; /* host memory, `length` elements */
  int32_t length;
} tilevox_harness_field;

typedef struct tilevox_harness_tensor {
  void* data;       /* device pointer; may be null when enqueue_count is 0 */
  char const* type; /* a DataType enumerator name: "kBF16", "kFLOAT", "kINT32", "kINT64", ... */
  int32_t nb_dims;
  int64_t dims[8];
} tilevox_harness_tensor;

typedef struct tilevox_harness_plugin_case {
  char const* lean_lib;
  char const* plugin_lib;
  char const* plugin_name;
  char const* plugin_version;
  char const* plugin_namespace;
  int32_t nb_fields;
  tilevox_harness_field const* fields;
  int32_t nb_inputs;
  tilevox_harness_tensor const* inputs;
  int32_t nb_outputs;
  tilevox_harness_tensor const* outputs;
  void* workspace;
  int64_t workspace_bytes;
  void* stream;
  /* 1: use the library-global registry (getPluginRegistry), which needs no CUDA; 0: an IRuntime's registry. */
  int32_t use_global_registry;
  /* enqueues on the one attached runtime plugin; 0: stop after onShapeChange (no CUDA call at all). */
  int32_t enqueue_count;
  /* >= 0: supportsFormatCombination must refuse this position once its type is changed (kFLOAT <-> kINT32). */
  int32_t reject_position;
} tilevox_harness_plugin_case;

/* Runs `c` as tilevox_harness_run does, for any plugin: every step is a PASS/FAIL line of `report`;
 * *workspaceNeeded receives getWorkspaceSize (-1 if not reached). Returns 0 when every check passed. */
__attribute__((visibility("default"))) int32_t tilevox_harness_run_plugin(tilevox_harness_plugin_case const* c,
                                                                           int64_t* workspaceNeeded, char* report,
                                                                           int32_t reportLen) {
  std::ostringstream log;
  int32_t failures = 0;
  auto check = [&](bool ok, std::string const& what) {
    log << (ok ? "PASS " : "FAIL ") << what << "\n";
    if (!ok) ++failures;
    return ok;
  };
  auto finish = [&](CollectingLogger* logger) {
    if (logger != nullptr) log << logger->messages.str();
    copyOut(log.str(), report, reportLen);
    return failures == 0 ? 0 : 1;
  };
  if (workspaceNeeded != nullptr) *workspaceNeeded = -1;
  if (!check(c != nullptr && c->nb_fields >= 0 && c->nb_inputs >= 0 && c->nb_outputs >= 1 &&
                 (c->nb_fields == 0 || c->fields != nullptr) && (c->nb_inputs == 0 || c->inputs != nullptr) &&
                 c->outputs != nullptr && c->enqueue_count >= 0,
             "case: counts and arrays are consistent")) {
    return finish(nullptr);
  }

  // The caller's descriptors, checked before TensorRT sees them.
  int32_t const nbIn = c->nb_inputs;
  int32_t const nbOut = c->nb_outputs;
  std::string malformed;
  auto problem = [&](std::string const& what) { malformed += (malformed.empty() ? "" : "; ") + what; };
  std::vector<DataType> types(nbIn + nbOut, DataType::kFLOAT);
  std::vector<DynamicPluginTensorDesc> desc(nbIn + nbOut);
  for (int32_t i = 0; i < nbIn + nbOut; ++i) {
    tilevox_harness_tensor const& t = i < nbIn ? c->inputs[i] : c->outputs[i - nbIn];
    std::string const what = (i < nbIn ? "input " : "output ") + std::to_string(i < nbIn ? i : i - nbIn);
    if (!parseDataType(t.type, types[i])) problem(what + " type " + (t.type ? t.type : "null") + " is no DataType");
    if (t.nb_dims < 0 || t.nb_dims > Dims::MAX_DIMS) {
      problem(what + " has " + std::to_string(t.nb_dims) + " dims");
      continue;
    }
    Dims const dims = makeDims(t.dims, t.nb_dims);
    desc[i].desc.dims = dims;
    desc[i].desc.type = types[i];
    desc[i].desc.format = TensorFormat::kLINEAR;
    desc[i].desc.scale = 1.0F;
    desc[i].min = desc[i].opt = desc[i].max = dims;
  }
  std::vector<PluginField> fields;
  for (int32_t i = 0; i < c->nb_fields; ++i) {
    tilevox_harness_field const& f = c->fields[i];
    PluginFieldType type = PluginFieldType::kUNKNOWN;
    if (f.name == nullptr || !parseFieldType(f.type, type) || f.length < 0 || (f.length > 0 && f.data == nullptr)) {
      problem("field " + std::to_string(i) + " (" + (f.name ? f.name : "null") + ", " + (f.type ? f.type : "null") +
              ") needs a name, a PluginFieldType name and data for its length");
      continue;
    }
    fields.emplace_back(f.name, f.data, type, f.length);
  }
  if (!check(malformed.empty(), "the case's " + std::to_string(nbIn) + " inputs, " + std::to_string(nbOut) +
                                    " outputs and " + std::to_string(c->nb_fields) + " fields are well formed" +
                                    (malformed.empty() ? std::string() : " (" + malformed + ")"))) {
    return finish(nullptr);
  }

  static CollectingLogger logger;  // TensorRT keeps the logger for the process lifetime
  LeanRegistry lean;
  if (!openLeanRegistry(c->lean_lib, c->plugin_lib, c->plugin_name, c->plugin_version, c->plugin_namespace,
                        c->use_global_registry != 0, /*logVersions=*/false, logger, log, check, lean)) {
    return finish(lean.reportLogger);
  }
  IRuntime* runtime = lean.runtime;
  IPluginRegistry& registry = *lean.registry;
  IPluginRegistry::PluginLibraryHandle libHandle = lean.libHandle;
  IPluginCreatorInterface* iface = lean.creator;
  IPluginV3* buildPlugin = nullptr;
  IPluginV3* runtimePlugin = nullptr;
  IPluginV3* attached = nullptr;
  bool enqueued = false;
  do {
    if (!check(iface != nullptr, std::string("getCreator(") + c->plugin_name + ", " + c->plugin_version + ", " +
                                     c->plugin_namespace + ")")) break;
    if (!check(std::strcmp(iface->getInterfaceInfo().kind, kV3OneKind) == 0, "creator is IPluginCreatorV3One")) break;
    auto* creator = static_cast<IPluginCreatorV3One*>(iface);

    // The ONNX parser passes only the attributes the creator declares: every given field must be declared.
    PluginFieldCollection const* declared = creator->getFieldNames();
    std::string undeclared;
    for (PluginField const& f : fields) {
      if (!declares(declared, f.name)) undeclared += std::string(undeclared.empty() ? "" : ", ") + f.name;
    }
    check(undeclared.empty(), "every given field is declared by getFieldNames" +
                                  (undeclared.empty() ? std::string() : " (not declared: " + undeclared + ")"));

    PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
    buildPlugin = creator->createPlugin(c->plugin_name, &fc, TensorRTPhase::kBUILD);
    if (!check(buildPlugin != nullptr, "createPlugin(kBUILD) from the given fields")) break;

    auto* core = static_cast<IPluginV3OneCore*>(buildPlugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(buildPlugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    if (!check(core != nullptr && build != nullptr, "core and build capabilities")) break;
    check(std::strcmp(core->getPluginName(), c->plugin_name) == 0 &&
              std::strcmp(core->getPluginVersion(), c->plugin_version) == 0 &&
              std::strcmp(core->getPluginNamespace(), c->plugin_namespace) == 0,
          "core name/version/namespace match the creator");
    if (!check(build->getNbOutputs() == nbOut, "getNbOutputs == " + std::to_string(nbOut) + " (got " +
                                                   std::to_string(build->getNbOutputs()) + ")")) break;

    std::vector<DataType> outTypes(nbOut, DataType::kFLOAT);
    bool typesOk = build->getOutputDataTypes(outTypes.data(), nbOut, types.data(), nbIn) == 0;
    std::string typeDetail;
    for (int32_t j = 0; typesOk && j < nbOut; ++j) {
      if (outTypes[j] != types[nbIn + j]) {
        typesOk = false;
        typeDetail = " (output " + std::to_string(j) + ": plugin says " + dataTypeName(outTypes[j]) + ", given " +
                     dataTypeName(types[nbIn + j]) + ")";
      }
    }
    check(typesOk, "getOutputDataTypes equal the given output types" + typeDetail);

    std::string refused;
    for (int32_t pos = 0; pos < nbIn + nbOut; ++pos) {
      if (!build->supportsFormatCombination(pos, desc.data(), nbIn, nbOut))
        refused += std::string(refused.empty() ? "" : ", ") + std::to_string(pos);
    }
    check(refused.empty(), "supportsFormatCombination accepts the given linear types at every position" +
                               (refused.empty() ? std::string() : " (refused: " + refused + ")"));
    if (c->reject_position >= 0 && c->reject_position < nbIn + nbOut) {
      std::vector<DynamicPluginTensorDesc> other = desc;
      DataType& t = other[c->reject_position].desc.type;
      t = t == DataType::kFLOAT ? DataType::kINT32 : DataType::kFLOAT;
      check(!build->supportsFormatCombination(c->reject_position, other.data(), nbIn, nbOut),
            "supportsFormatCombination refuses position " + std::to_string(c->reject_position) + " as " +
                dataTypeName(t));
    } else if (c->reject_position >= 0) {
      check(false, "reject_position " + std::to_string(c->reject_position) + " is a tensor position");
    }
    if (!check(build->configurePlugin(desc.data(), nbIn, desc.data() + nbIn, nbOut) == 0, "configurePlugin")) break;
    std::size_t const ws = build->getWorkspaceSize(desc.data(), nbIn, desc.data() + nbIn, nbOut);
    if (workspaceNeeded != nullptr) *workspaceNeeded = static_cast<int64_t>(ws);
    log << "INFO workspace bytes " << ws << "\n";
    if (c->enqueue_count > 0 &&
        !check(static_cast<int64_t>(ws) <= c->workspace_bytes && (ws == 0 || c->workspace != nullptr),
               "workspace fits the caller's buffer (" + std::to_string(c->workspace_bytes) + " bytes)")) break;

    // Serialization round trip: what getFieldsToSerialize returns is all a plan stores; copy it as a plan does.
    auto* buildRt =
        static_cast<IPluginV3OneRuntime*>(buildPlugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    if (!check(buildRt != nullptr, "build-phase object has the runtime capability")) break;
    OwnedFields stored;
    std::string why;
    bool const copied = stored.copy(buildRt->getFieldsToSerialize(), why);
    if (!check(copied, "getFieldsToSerialize returns fields a plan can store" + (why.empty() ? "" : ": " + why))) break;
    std::string notDeclared, lost;
    for (PluginField const& s : stored.fields()) {
      if (!declares(declared, s.name)) notDeclared += std::string(notDeclared.empty() ? "" : ", ") + s.name;
    }
    for (PluginField const& f : fields) {
      bool found = false;
      for (PluginField const& s : stored.fields()) found |= std::strcmp(s.name, f.name) == 0 && sameFieldValues(s, f);
      if (!found) lost += std::string(lost.empty() ? "" : ", ") + f.name;
    }
    check(notDeclared.empty(), "serialized fields are declared by getFieldNames" +
                                   (notDeclared.empty() ? std::string() : " (not declared: " + notDeclared + ")"));
    check(lost.empty(), "serialized fields carry every given field with its values" +
                            (lost.empty() ? std::string() : " (missing or changed: " + lost + ")"));
    runtimePlugin = creator->createPlugin(c->plugin_name, stored.collection(), TensorRTPhase::kRUNTIME);
    if (!check(runtimePlugin != nullptr, "createPlugin(kRUNTIME) from the serialized fields")) break;
    auto* rt0 =
        static_cast<IPluginV3OneRuntime*>(runtimePlugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    if (!check(rt0 != nullptr, "runtime capability")) break;
    attached = rt0->attachToContext(nullptr);
    if (!check(attached != nullptr, "attachToContext")) break;
    auto* rt = static_cast<IPluginV3OneRuntime*>(attached->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    if (!check(rt != nullptr, "attached plugin's runtime capability")) break;

    std::vector<PluginTensorDesc> td(nbIn + nbOut);
    for (int32_t i = 0; i < nbIn + nbOut; ++i) td[i] = desc[i].desc;
    if (!check(rt->onShapeChange(td.data(), nbIn, td.data() + nbIn, nbOut) == 0, "onShapeChange")) break;
    if (c->enqueue_count == 0) {
      log << "SKIP enqueue: enqueue_count is 0\n";
      break;
    }
    std::vector<void const*> inPtrs(nbIn);
    std::vector<void*> outPtrs(nbOut);
    bool bound = true;
    for (int32_t i = 0; i < nbIn; ++i) bound &= (inPtrs[i] = c->inputs[i].data) != nullptr;
    for (int32_t j = 0; j < nbOut; ++j) bound &= (outPtrs[j] = c->outputs[j].data) != nullptr;
    if (!check(bound, "every input and output has a device buffer")) break;
    for (int32_t k = 0; k < c->enqueue_count; ++k) {
      enqueued = true;
      if (!check(rt->enqueue(td.data(), td.data() + nbIn, inPtrs.data(), outPtrs.data(), c->workspace,
                             static_cast<cudaStream_t>(c->stream)) == 0,
                 "enqueue " + std::to_string(k + 1) + " of " + std::to_string(c->enqueue_count) + " returned 0")) break;
    }
  } while (false);

  if (enqueued) {  // the plugins may free device memory the enqueued work still reads: let it finish first
    std::string detail;
    check(synchronizeStream(c->stream, detail) == 0, "cuStreamSynchronize after enqueue (" + detail + ")");
  }
  delete attached;
  delete runtimePlugin;
  delete buildPlugin;
  registry.deregisterLibrary(libHandle);
  delete runtime;
  return finish(&logger);
}

}  // extern "C"
