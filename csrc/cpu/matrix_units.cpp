// The CPU path choice and ATen brgemm wrappers (matrix_units.h), and three
// introspection ops: cpu_path_info (which path a dtype takes now, and why),
// cpu_path_counts (calls per path, for tests) and cpu_features (the ISA
// flags the benchmarks print beside their tables).
#include "matrix_units.h"

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define FLASH_METAL_X86_CPUID 1
#endif

// torch >= 2.6 declares the 16-bit brgemm overloads and says so with these
// macros (ATen/native/CPUBlas.h); the oldest supported torch (2.4) has none,
// and there the brgemm path is unavailable.
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F16F16F32)
#define FLASH_METAL_HAS_BRGEMM 1
#endif

namespace flash_metal {
namespace cpu {
namespace {

// Calls per path: [forward vector, forward brgemm, backward vector, backward brgemm].
std::atomic<int64_t> g_counts[4];

#ifdef FLASH_METAL_X86_CPUID
CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(1, 0, &a, &b, &c, &d)) return f;
  const bool osxsave = (c >> 27) & 1, fma = (c >> 12) & 1;
  uint64_t xcr0 = 0;
  if (osxsave) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (uint64_t(hi) << 32) | lo;
  }
  // XCR0 bits: 1-2 SSE/AVX state, 5-7 the AVX-512 opmask and zmm state, 17-18 the AMX tile state.
  const bool os_avx = (xcr0 & 0x6) == 0x6, os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  f.fma = fma && os_avx;
  f.avx2 = os_avx && ((b >> 5) & 1);
  f.avx512f = os_avx512 && ((b >> 16) & 1);
  f.avx512_fp16 = os_avx512 && ((d >> 23) & 1);
  f.amx_bf16 = os_amx && ((d >> 22) & 1);
  f.amx_tile = os_amx && ((d >> 24) & 1);
  unsigned a1 = 0, b1, c1, d1;
  if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) {
    f.avx512_bf16 = os_avx512 && ((a1 >> 5) & 1);
    f.amx_fp16 = os_amx && ((a1 >> 21) & 1);
  }
  return f;
}
#else
CpuFeatures detect() { return CpuFeatures{}; }
#endif

const char* dtype_name(at::ScalarType t) {
  return t == at::kBFloat16 ? "bfloat16" : t == at::kHalf ? "float16" : t == at::kFloat ? "float32" : "other";
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

bool brgemm_compiled() {
#ifdef FLASH_METAL_HAS_BRGEMM
  return true;
#else
  return false;
#endif
}

// Whether ATen can pack this 16-bit dtype for the matrix units: asked once
// per dtype (the CPU does not change under a running process).
static bool packable_16(at::ScalarType dtype) {
#ifdef FLASH_METAL_HAS_BRGEMM
  static const bool bf16 = at::native::cpublas::could_pack(at::kBFloat16);
  static const bool f16 = at::native::cpublas::could_pack(at::kHalf);
  return dtype == at::kBFloat16 ? bf16 : dtype == at::kHalf ? f16 : false;
#else
  (void)dtype;
  return false;
#endif
}

PathChoice choose_cpu_path(at::ScalarType dtype, bool backward) {
  // Read at every call (tests and benchmarks switch it between calls), but
  // with plain C-string compares: no allocation on the kernels' hot path.
  const char* env = std::getenv("FLASH_METAL_CPU_PATH");
  const bool is_auto = env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0;
  const bool is_vector = !is_auto && std::strcmp(env, "vector") == 0;
  const bool is_brgemm = !is_auto && std::strcmp(env, "brgemm") == 0;
  TORCH_CHECK_VALUE(is_auto || is_vector || is_brgemm, "FLASH_METAL_CPU_PATH='", env,
                    "' is not a CPU path; allowed: 'auto' (default), 'vector' or 'brgemm'");
  PathChoice pc;
  const bool sixteen = dtype == at::kBFloat16 || dtype == at::kHalf;
  const bool packable = sixteen && packable_16(dtype);
  if (is_vector) {
    pc.why = PathWhy::ForcedVector;
  } else if (is_brgemm) {
    if (!sixteen) {
      pc.why = PathWhy::ForcedBrgemmFloat32;
      return pc;
    }
    TORCH_CHECK(brgemm_compiled(), "FLASH_METAL_CPU_PATH=brgemm: this torch has no at::native::cpublas::brgemm for 16-bit inputs (torch >= 2.6 has); use 'auto' or 'vector'");
    pc.path = CpuPath::Brgemm;
    pc.vnni = packable && !backward;
    pc.why = PathWhy::ForcedBrgemm;
  } else if (backward && sixteen) {  // the backward's brgemm products have no VNNI packing yet (issue 22 step 3)
    pc.why = PathWhy::AutoBackward16;
  } else if (packable) {
    pc.path = CpuPath::Brgemm;
    pc.vnni = true;
    pc.why = PathWhy::AutoMatrixUnits;
  } else {
    pc.why = sixteen ? PathWhy::AutoNoMatrixUnits : PathWhy::AutoFloat32;
  }
  return pc;
}

std::string describe_cpu_path(const PathChoice& pc, at::ScalarType dtype, bool backward) {
  const std::string what = std::string(backward ? "backward" : "forward") + " " + dtype_name(dtype);
  switch (pc.why) {
    case PathWhy::ForcedVector:
      return what + ": vector (float32 FMA tiles), forced by FLASH_METAL_CPU_PATH=vector";
    case PathWhy::ForcedBrgemmFloat32:
      return what + ": vector; FLASH_METAL_CPU_PATH=brgemm covers 16-bit dtypes only, float32 keeps its FMA tiles";
    case PathWhy::ForcedBrgemm:
      return what + ": brgemm, forced by FLASH_METAL_CPU_PATH=brgemm; " +
             (pc.vnni ? "VNNI-packed B on the matrix units (AMX)"
                      : backward ? "non-VNNI brgemm calls (the backward does not pack for AMX yet)"
                                 : "ATen's non-VNNI fallback (no AMX for this dtype here)");
    case PathWhy::AutoBackward16:
      return what + ": vector (auto: the backward's brgemm path runs without VNNI packing, so not on AMX; "
                    "FLASH_METAL_CPU_PATH=brgemm forces it)";
    case PathWhy::AutoMatrixUnits:
      return what + ": brgemm on the matrix units (auto: ATen can pack " + dtype_name(dtype) + " for AMX here)";
    case PathWhy::AutoNoMatrixUnits:
      return what + ": vector (auto: no AMX for " + dtype_name(dtype) +
             " here, and ATen's non-AMX brgemm does not beat the FMA tiles)";
    case PathWhy::AutoFloat32:
      return what + ": vector (auto: float32 always runs the FMA tiles)";
  }
  return what;
}

void count_cpu_path(CpuPath path, bool backward) { ++g_counts[(backward ? 2 : 0) + static_cast<int>(path)]; }

#ifdef FLASH_METAL_HAS_BRGEMM
void tile_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
               const c10::BFloat16* a, const c10::BFloat16* b, float* c, bool vnni) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_c, a, b, c, vnni);
}
void tile_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
               const c10::Half* a, const c10::Half* b, float* c, bool vnni) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_c, a, b, c, vnni);
}
void tile_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c, const float* a,
               const float* b, float* c, bool vnni) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_c, a, b, c, vnni);
}
void pack_b(int64_t K, int64_t N, int64_t ld_in, at::ScalarType dtype, const void* in, void* out) {
  at::native::cpublas::pack(K, N, ld_in, N, dtype, dtype, in, out);
}
void tile_release(bool vnni) {
  if (vnni) at::native::cpublas::brgemm_release(true);
}
#else
void tile_gemm(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, const c10::BFloat16*,
               const c10::BFloat16*, float*, bool) {
  TORCH_CHECK(false, "flash_metal: brgemm is unavailable in this torch");
}
void tile_gemm(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, const c10::Half*, const c10::Half*, float*,
               bool) {
  TORCH_CHECK(false, "flash_metal: brgemm is unavailable in this torch");
}
void tile_gemm(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, const float*, const float*, float*, bool) {
  TORCH_CHECK(false, "flash_metal: brgemm is unavailable in this torch");
}
void pack_b(int64_t, int64_t, int64_t, at::ScalarType, const void*, void*) {
  TORCH_CHECK(false, "flash_metal: cpublas::pack is unavailable in this torch");
}
void tile_release(bool) {}
#endif

namespace {

std::tuple<std::string, std::string, bool> cpu_path_info(at::ScalarType dtype, bool backward) {
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                    "flash_metal.cpu_path_info: dtype must be float32, float16 or bfloat16; got ", dtype);
  const PathChoice pc = choose_cpu_path(dtype, backward);
  return {pc.path == CpuPath::Brgemm ? "brgemm" : "vector", describe_cpu_path(pc, dtype, backward), pc.vnni};
}

std::vector<int64_t> cpu_path_counts() {
  std::vector<int64_t> out;
  for (auto& c : g_counts) out.push_back(c.load());
  return out;
}

// Names and 0/1 values of the flags, plus whether this torch has brgemm and
// whether ATen can pack bfloat16 / float16 for the matrix units.
std::tuple<std::vector<std::string>, std::vector<int64_t>> cpu_features_op() {
  const CpuFeatures& f = cpu_features();
  const bool pack_bf16 = packable_16(at::kBFloat16), pack_f16 = packable_16(at::kHalf);
  return {{"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16",
           "torch_brgemm", "could_pack_bf16", "could_pack_f16"},
          {f.avx2, f.fma, f.avx512f, f.avx512_bf16, f.avx512_fp16, f.amx_tile, f.amx_bf16, f.amx_fp16,
           brgemm_compiled(), pack_bf16, pack_f16}};
}

// b (K x N, bfloat16/float16, K even) packed by pack_b, flattened: lets the
// tests check the VNNI layout brgemm_tiles.h relies on, where could_pack.
at::Tensor cpu_vnni_pack(const at::Tensor& b) {
  TORCH_CHECK_VALUE(b.dim() == 2 && b.device().is_cpu() && b.size(0) % 2 == 0 &&
                        (b.scalar_type() == at::kBFloat16 || b.scalar_type() == at::kHalf),
                    "flash_metal.cpu_vnni_pack: b must be a 2-D CPU bfloat16/float16 tensor with an even row count");
#ifdef FLASH_METAL_HAS_BRGEMM
  TORCH_CHECK(at::native::cpublas::could_pack(b.scalar_type()),
              "flash_metal.cpu_vnni_pack: ATen cannot pack this dtype for the matrix units on this CPU");
#endif
  const at::Tensor in = b.contiguous();
  at::Tensor out = at::empty({b.numel()}, b.options());
  pack_b(b.size(0), b.size(1), b.size(1), b.scalar_type(), in.const_data_ptr(), out.mutable_data_ptr());
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace flash_metal

TORCH_LIBRARY_FRAGMENT(flash_metal, m) {
  // Which CPU tile-product path a call of this dtype takes now, and why
  // (FLASH_METAL_CPU_PATH, csrc/cpu/matrix_units.h): (path, reason, vnni).
  m.def("cpu_path_info(ScalarType dtype, bool backward=False) -> (str path, str reason, bool vnni)",
        &flash_metal::cpu::cpu_path_info);
  // CPU kernel calls so far per path: [fwd vector, fwd brgemm, bwd vector, bwd brgemm].
  m.def("cpu_path_counts() -> int[]", &flash_metal::cpu::cpu_path_counts);
  m.def("cpu_features() -> (str[] names, int[] values)", &flash_metal::cpu::cpu_features_op);
  m.def("cpu_vnni_pack(Tensor b) -> Tensor", &flash_metal::cpu::cpu_vnni_pack);
}
