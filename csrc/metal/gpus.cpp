// The Apple GPUs the planner knows by name (GpuSpec in csrc/metal/plan.h), and
// the per-launch estimates (LaunchEstimate): registers per lane and the
// threadgroups / SIMD-groups a core keeps resident. These are models for
// explain() and benchmarks/model/families/prefill.py, never measurements; only the
// split-KV decode's block count depends on them (through `cores`).
//
// Sources (benchmarks/model/core/gpus.py holds the same chips with the same keys;
// tests/model/test_metal_model_anchors.py checks that the two tables agree):
//   cores: philipturner/metal-benchmarks' GPU table (M1 and M2 families);
//     Apple's announcements for M3 (10/18/40, M3 Ultra 80), M4 (10/20/40)
//     and M5 (10).
//   threadgroup memory per core: metal-benchmarks "Shared Memory ~60 KB"
//     (Apple 7 and 8: M1, M2); 32 KiB for Apple 9 and later, an estimate
//     (Dynamic Caching publishes no fixed size; the smallest budget
//     consistent with reports that ~15 KB threadgroups run two per core and
//     ~23 KB one).
//   register file per core: ~208 KB (metal-benchmarks' register figures,
//     as /work/shared/notes/fast-kernels.md gives them), every generation: an
//     estimate past M2.
#include "metal/plan_detail.h"

#include <cctype>
#include <cstdlib>

namespace flash_metal {

using namespace plan_detail;

namespace {

// Why 60 KB / 32 KiB / 208 KB: see the sources above.
constexpr uint32_t kTgMemoryApple78 = 60 * 1024;
constexpr uint32_t kTgMemoryApple9 = 32 * 1024;
constexpr uint32_t kRegisterFile = 208 * 1024;

struct Chip {
  const char* key;   // the `gpu` argument's spelling
  const char* name;  // as MTLDevice.name ends ("Apple M3 Pro")
  uint32_t cores;
  uint32_t tg_memory;
};

// MTLGPUFamilyApple<N> of an M-generation: M1 is Apple 7, each generation
// one more, except that M3 and M4 are both Apple 9 (Apple's Metal feature
// set tables); M5 is Apple 10. A later "M6" counts as at least Apple 10.
uint32_t family_of_generation(int generation) {
  if (generation <= 0) return 0;
  if (generation <= 3) return 6 + static_cast<uint32_t>(generation);
  if (generation == 4) return 9;
  return 5 + static_cast<uint32_t>(generation);
}

// The generation in a chip key or normalized device name ("m3-pro" -> 3), 0 if none.
int generation_of(const std::string& key) {
  if (key.size() < 2 || key[0] != 'm' || !std::isdigit(static_cast<unsigned char>(key[1]))) return 0;
  int g = 0;
  for (size_t i = 1; i < key.size() && std::isdigit(static_cast<unsigned char>(key[i])); ++i) g = g * 10 + (key[i] - '0');
  return g;
}

constexpr Chip kChips[] = {
    {"m1", "M1", 8, kTgMemoryApple78},          {"m1-pro", "M1 Pro", 16, kTgMemoryApple78},
    {"m1-max", "M1 Max", 32, kTgMemoryApple78}, {"m1-ultra", "M1 Ultra", 64, kTgMemoryApple78},
    {"m2", "M2", 10, kTgMemoryApple78},         {"m2-pro", "M2 Pro", 19, kTgMemoryApple78},
    {"m2-max", "M2 Max", 38, kTgMemoryApple78}, {"m2-ultra", "M2 Ultra", 76, kTgMemoryApple78},
    {"m3", "M3", 10, kTgMemoryApple9},          {"m3-pro", "M3 Pro", 18, kTgMemoryApple9},
    {"m3-max", "M3 Max", 40, kTgMemoryApple9},  {"m3-ultra", "M3 Ultra", 80, kTgMemoryApple9},
    {"m4", "M4", 10, kTgMemoryApple9},          {"m4-pro", "M4 Pro", 20, kTgMemoryApple9},
    {"m4-max", "M4 Max", 40, kTgMemoryApple9},  {"m5", "M5", 10, kTgMemoryApple9},
    // M5 Pro / Max: Apple's Mar 2026 announcement (benchmarks/model/core/gpus.py
    // "apple-m5-pro", "apple-m5-max"): up to 20 and 40 cores.
    {"m5-pro", "M5 Pro", 20, kTgMemoryApple9},  {"m5-max", "M5 Max", 40, kTgMemoryApple9},
};

GpuClass class_of_name(const std::string& name) {
  const auto ends_with = [&](const std::string& tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  if (ends_with(" Ultra") || ends_with("-ultra")) return GpuClass::Ultra;
  if (ends_with(" Max") || ends_with("-max")) return GpuClass::Max;
  return GpuClass::Base;
}

GpuSpec spec_of(const Chip& c) {
  GpuSpec spec{c.name, class_of_name(c.name), c.cores, c.tg_memory, kRegisterFile};
  spec.family = family_of_generation(generation_of(c.key));
  return spec;
}

// The representative chip of each class: the M3 generation's.
GpuSpec representative(GpuClass cls) {
  const char* key = cls == GpuClass::Ultra ? "m3-ultra" : cls == GpuClass::Max ? "m3-max" : "m3";
  for (const Chip& c : kChips) {
    if (std::string(c.key) == key) return spec_of(c);
  }
  TORCH_CHECK(false, "flash_metal: internal error: no chip ", key);
}

// "M3 Pro", "m3-pro", "M3_PRO" -> "m3-pro".
std::string normalized(const std::string& name) {
  std::string out;
  for (char ch : name) {
    if (ch == ' ' || ch == '_' || ch == '-') {
      if (!out.empty() && out.back() != '-') out += '-';
    } else {
      out += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    }
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out;
}

}  // namespace

std::string tensor_ops_switched_off() {
  const char* value = std::getenv(kDisableTensorOpsEnv);
  return value != nullptr && std::string(value) == "1" ? std::string(kDisableTensorOpsEnv) + "=1 turns them off" : "";
}

GpuClass parse_gpu_class(const std::string& name) {
  if (name == "base") return GpuClass::Base;
  if (name == "max") return GpuClass::Max;
  if (name == "ultra") return GpuClass::Ultra;
  TORCH_CHECK_VALUE(false, kOp, ": gpu must be one of 'base', 'max', 'ultra'; got '", name, "'");
}

GpuClass gpu_class_from_device_name(const std::string& name) { return class_of_name(name); }

GpuSpec parse_gpu(const std::string& name) {
  // "<gpu>+tensor_ops": as a Mac process with macOS 26.2 and the MSL 4 library.
  const std::string suffix = "+tensor_ops";
  if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    GpuSpec spec = parse_gpu(name.substr(0, name.size() - suffix.size()));
    spec.tensor_ops_missing = tensor_ops_switched_off();
    return spec;
  }
  const std::string key = normalized(name);
  if (key == "base") return representative(GpuClass::Base);
  if (key == "max") return representative(GpuClass::Max);
  if (key == "ultra") return representative(GpuClass::Ultra);
  std::string known;
  for (const Chip& c : kChips) {
    if (key == c.key) return spec_of(c);
    known += std::string(known.empty() ? "" : ", ") + "'" + c.key + "'";
  }
  TORCH_CHECK_VALUE(false, kOp, ": gpu must be a class ('base', 'max', 'ultra') or a chip (", known,
                    "), optionally with '+tensor_ops'; got '", name, "'");
}

GpuSpec gpu_from_device_name(const std::string& name) {
  std::string key = normalized(name);
  if (key.rfind("apple-", 0) == 0) key = key.substr(6);
  for (const Chip& c : kChips) {
    if (key == c.key) return spec_of(c);
  }
  // An unknown chip plans as its class's representative, in its own
  // generation's GPU family ("Apple M6 Max": a Max, Apple 11).
  GpuSpec spec = representative(class_of_name(name));
  if (const int g = generation_of(key)) spec.family = family_of_generation(g);
  return spec;
}

std::vector<GpuSpec> known_gpus() {
  std::vector<GpuSpec> out;
  for (const Chip& c : kChips) out.push_back(spec_of(c));
  return out;
}

LaunchEstimate plan_detail::estimate_launch(const MetalLaunch& launch, uint32_t live_registers, const GpuSpec& gpu) {
  LaunchEstimate e;
  e.live_registers = live_registers;
  const uint32_t simdgroups = static_cast<uint32_t>((threads_of(launch) + 31) / 32);
  // A SIMD-group holds live_registers 4-byte values in each of its 32 lanes.
  const uint64_t tg_register_bytes = uint64_t{live_registers} * 4 * 32 * simdgroups;
  const uint64_t by_registers = tg_register_bytes ? gpu.register_file_per_core / tg_register_bytes : UINT32_MAX;
  const uint64_t by_memory =
      launch.threadgroup_memory ? gpu.threadgroup_memory_per_core / launch.threadgroup_memory : UINT32_MAX;
  e.limit = by_registers <= by_memory ? "registers" : "threadgroup memory";
  e.threadgroups_per_core = static_cast<uint32_t>(std::max<uint64_t>(1, std::min(by_registers, by_memory)));
  e.simdgroups_per_core = e.threadgroups_per_core * simdgroups;
  return e;
}

}  // namespace flash_metal
