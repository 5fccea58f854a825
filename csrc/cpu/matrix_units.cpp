// The CPU path choice and ATen brgemm wrappers (matrix_units.h), and three
// introspection ops: cpu_path_info (which path a dtype takes now, and why),
// cpu_path_counts (calls per path, for tests) and cpu_features (the ISA
// flags the benchmarks print beside their tables).
#include "matrix_units.h"

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
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

// Calls per path: [forward vector, forward brgemm, backward vector, backward
// brgemm], then the brgemm calls of each pass that emulated VNNI, then the
// emulated tile products run (any pass): the tests' proof the seam ran;
// then the forward calls that took the column form (brgemm_cols.h), then the
// float32 backward's query blocks that took the first pass (backward_precise.h).
// Then the float16 forward calls that took the split bfloat16 form (brgemm_split.h).
constexpr int kEmuFwd = 4, kEmuBwd = 5, kEmuGemm = 6, kColsFwd = 7, kRenormBwd = 8, kSplitFwd = 9, kKeySplitFwd = 10;
std::atomic<int64_t> g_counts[11];

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

PathChoice choose_path_rule(PathMode mode, VnniMode vnni, bool sixteen, bool packable) {
  PathChoice pc;
  if (mode == PathMode::Vector) {
    pc.why = PathWhy::ForcedVector;
  } else if (!sixteen) {
    pc.why = mode == PathMode::Brgemm ? PathWhy::ForcedBrgemmFloat32 : PathWhy::AutoFloat32;
  } else if (mode == PathMode::Brgemm) {
    pc.path = CpuPath::Brgemm;
    pc.vnni = vnni == VnniMode::Emulate ? Vnni::Emulated
              : vnni == VnniMode::Auto && packable ? Vnni::Aten
                                                   : Vnni::Off;
    pc.why = PathWhy::ForcedBrgemm;
  } else if (vnni == VnniMode::Emulate) {
    pc.path = CpuPath::Brgemm;
    pc.vnni = Vnni::Emulated;
    pc.why = PathWhy::AutoEmulated;
  } else if (vnni == VnniMode::Off) {
    pc.why = PathWhy::AutoVnniOff;
  } else if (packable) {
    pc.path = CpuPath::Brgemm;
    pc.vnni = Vnni::Aten;
    pc.why = PathWhy::AutoMatrixUnits;
  } else {
    pc.why = PathWhy::AutoNoMatrixUnits;
  }
  return pc;
}

PathChoice choose_cpu_path(at::ScalarType dtype, bool backward) {
  // Read at every call (tests and benchmarks switch them between calls), but
  // with plain C-string compares: no allocation on the kernels' hot path.
  const char* env = std::getenv("FLASH_METAL_CPU_PATH");
  PathMode mode = PathMode::Auto;
  if (env != nullptr && *env != '\0' && std::strcmp(env, "auto") != 0) {
    const bool is_vector = std::strcmp(env, "vector") == 0, is_brgemm = std::strcmp(env, "brgemm") == 0;
    TORCH_CHECK_VALUE(is_vector || is_brgemm, "FLASH_METAL_CPU_PATH='", env,
                      "' is not a CPU path; allowed: 'auto' (default), 'vector' or 'brgemm'");
    mode = is_vector ? PathMode::Vector : PathMode::Brgemm;
  }
  const char* venv = std::getenv("FLASH_METAL_CPU_VNNI");
  VnniMode vm = VnniMode::Auto;
  if (venv != nullptr && *venv != '\0' && std::strcmp(venv, "auto") != 0) {
    const bool is_emulate = std::strcmp(venv, "emulate") == 0, is_off = std::strcmp(venv, "off") == 0;
    TORCH_CHECK_VALUE(is_emulate || is_off, "FLASH_METAL_CPU_VNNI='", venv,
                      "' is not a VNNI mode; allowed: 'auto' (default), 'emulate' or 'off'");
    vm = is_emulate ? VnniMode::Emulate : VnniMode::Off;
  }
  const bool sixteen = dtype == at::kBFloat16 || dtype == at::kHalf;
  PathChoice pc = choose_path_rule(mode, vm, sixteen, sixteen && packable_16(dtype));
  // float16 forward where float16 has no AMX: on the bfloat16 tiles as split pairs
  // (brgemm_split.h): auto takes it where bfloat16 packs; a forced or emulated
  // brgemm forward of float16 splits wherever float16 itself does not pack.
  if (dtype == at::kHalf && !backward && !packable_16(at::kHalf)) {
    if (pc.path == CpuPath::Brgemm) {
      if (pc.vnni == Vnni::Off && vm == VnniMode::Auto && packable_16(at::kBFloat16)) pc.vnni = Vnni::Aten;
      pc.split = pc.vnni != Vnni::Off;
    } else if (pc.why == PathWhy::AutoNoMatrixUnits && packable_16(at::kBFloat16)) {
      pc.path = CpuPath::Brgemm;
      pc.vnni = Vnni::Aten;
      pc.why = PathWhy::AutoSplitBf16;
      pc.split = true;
    }
  }
  // The emulation needs nothing of ATen's; the other brgemm modes need its brgemm.
  TORCH_CHECK(pc.path != CpuPath::Brgemm || pc.vnni == Vnni::Emulated || brgemm_compiled(),
              "FLASH_METAL_CPU_PATH=brgemm: this torch has no at::native::cpublas::brgemm for 16-bit inputs "
              "(torch >= 2.6 has); use 'auto' or 'vector' (or FLASH_METAL_CPU_VNNI=emulate, the scalar test seam)");
  return pc;
}

std::string describe_cpu_path(const PathChoice& pc, at::ScalarType dtype, bool backward) {
  const std::string what = std::string(backward ? "backward" : "forward") + " " + dtype_name(dtype);
  const char* emulated =
      "VNNI emulated (FLASH_METAL_CPU_VNNI=emulate: pair-interleaved B packed and multiplied by this project's "
      "scalar code, a test seam, slow)";
  const std::string tail = pc.split && pc.why != PathWhy::AutoSplitBf16
                               ? "; each float16 split exactly into two bfloat16s for the bfloat16 tile products"
                               : "";
  const auto sentence = [&]() -> std::string {
    switch (pc.why) {
      case PathWhy::ForcedVector:
        return what + ": vector (float32 FMA tiles), forced by FLASH_METAL_CPU_PATH=vector";
      case PathWhy::ForcedBrgemmFloat32:
        return what + ": vector; FLASH_METAL_CPU_PATH=brgemm covers 16-bit dtypes only, float32 keeps its FMA tiles";
      case PathWhy::ForcedBrgemm:
        return what + ": brgemm, forced by FLASH_METAL_CPU_PATH=brgemm; " +
               (pc.vnni == Vnni::Aten       ? "VNNI-packed B on the matrix units (AMX)"
                : pc.vnni == Vnni::Emulated ? emulated
                                            : "ATen's non-VNNI calls (no AMX for this dtype here, or "
                                              "FLASH_METAL_CPU_VNNI=off)");
      case PathWhy::AutoMatrixUnits:
        return what + ": brgemm on the matrix units (auto: ATen can pack " + dtype_name(dtype) + " for AMX here)";
      case PathWhy::AutoEmulated:
        return what + ": brgemm, " + emulated + " (auto, as if the matrix units were there)";
      case PathWhy::AutoVnniOff:
        return what + ": vector (auto: FLASH_METAL_CPU_VNNI=off keeps brgemm off the matrix units)";
      case PathWhy::AutoNoMatrixUnits:
        return what + ": vector (auto: no AMX for " + dtype_name(dtype) +
               " here, and ATen's non-AMX brgemm does not beat the FMA tiles)";
      case PathWhy::AutoFloat32:
        return what + ": vector (auto: float32 always runs the FMA tiles)";
      case PathWhy::AutoSplitBf16:
        return what + ": brgemm on the bfloat16 matrix units, each float16 split exactly into two bfloat16s "
                      "(auto: no AMX for float16 here; four tile products per score, three per output term; query blocks "
                      "under 32 columns run the vector path)";
    }
    return what;
  };
  return sentence() + tail;
}

void count_cpu_cols_form() { ++g_counts[kColsFwd]; }
void count_cpu_renormalized_block() { ++g_counts[kRenormBwd]; }
void count_cpu_split_form() { ++g_counts[kSplitFwd]; }
void count_cpu_key_split() { ++g_counts[kKeySplitFwd]; }

void count_cpu_path(const PathChoice& pc, bool backward) {
  ++g_counts[(backward ? 2 : 0) + static_cast<int>(pc.path)];
  if (pc.path == CpuPath::Brgemm && pc.vnni == Vnni::Emulated) ++g_counts[backward ? kEmuBwd : kEmuFwd];
}

// ---- the emulated VNNI operands and products (Vnni::Emulated): scalar,
// written from the layout's definition, so the kernels' packed-operand code
// is checked against a layout independent of oneDNN's.
namespace {

// One column block, as ATen's pack (oneDNN's transform) is called: it
// refuses an ld_out oneDNN refuses, with oneDNN's words, so a kernel that
// would pack more than 64 columns at once fails here on every CPU.
void emulated_pack_block(int64_t K, int64_t N, int64_t ld_in, int64_t ld_out, const uint16_t* in, uint16_t* out) {
  TORCH_CHECK(pack_ld_ok(ld_out),
              "could not create a BRGeMM ukernel packing B object (flash_metal's VNNI emulation refuses what "
              "ATen's cpublas::pack refuses: ld_out must be 16, 32, 48 or 64; got ", ld_out, ")");
  TORCH_CHECK(K % 2 == 0, "flash_metal: a VNNI pack needs an even row count (pad with a zero row); got ", K);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < ld_out; ++n) out[(k / 2) * 2 * ld_out + 2 * n + k % 2] = n < N ? in[k * ld_in + n] : 0;
}

// C = [C +] A . B, B in the VNNI layout (pair p of rows at b + p * 2 * ldb),
// accumulated in float32 straight into C, pair by pair, as the AMX
// dot-product instructions do.
template <typename T>
void emulated_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c, const T* a,
                   const T* b, float* c) {
  TORCH_CHECK(K % 2 == 0, "flash_metal: a VNNI product needs an even reduction dim (pad with zeros); got ", K);
  ++g_counts[kEmuGemm];
  for (int64_t m = 0; m < M; ++m) {
    float* crow = c + m * ldc;
    if (!add_c) std::fill(crow, crow + N, 0.0f);
    const T* arow = a + m * lda;
    for (int64_t p = 0; p < K / 2; ++p) {
      const float a0 = static_cast<float>(arow[2 * p]), a1 = static_cast<float>(arow[2 * p + 1]);
      const T* bp = b + p * 2 * ldb;
      for (int64_t n = 0; n < N; ++n)
        crow[n] += a0 * static_cast<float>(bp[2 * n]) + a1 * static_cast<float>(bp[2 * n + 1]);
    }
  }
}

// C = [C +] A . B with B in the blocked VNNI layout (matrix_units.h): one
// product per column block, its B rows ld_out = pack_block_ld(nb) apart.
template <typename T>
void packed_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c, const T* a,
                 const T* b, float* c, Vnni vnni) {
  TORCH_CHECK(ldb == N, "flash_metal: a packed B operand is read with its own N (ldb ", ldb, " != N ", N, ")");
  for (int64_t c0 = 0; c0 < N; c0 += kPackBlock) {
    const int64_t nb = std::min(kPackBlock, N - c0), ldo = pack_block_ld(nb);
    if (vnni == Vnni::Emulated) {
      emulated_gemm(M, nb, K, lda, ldo, ldc, add_c, a, b + K * c0, c + c0);
    } else {
#ifdef FLASH_METAL_HAS_BRGEMM
      at::native::cpublas::brgemm(M, nb, K, lda, ldo, ldc, add_c, a, b + K * c0, c + c0, true);
#else
      TORCH_CHECK(false, "flash_metal: brgemm is unavailable in this torch");
#endif
    }
  }
}

template <typename T>
void tile_gemm_16(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c, const T* a,
                  const T* b, float* c, Vnni vnni) {
  if (packs(vnni)) return packed_gemm(M, N, K, lda, ldb, ldc, add_c, a, b, c, vnni);
#ifdef FLASH_METAL_HAS_BRGEMM
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_c, a, b, c, false);
#else
  TORCH_CHECK(false, "flash_metal: brgemm is unavailable in this torch");
#endif
}

template <typename T>
void tile_gemm_vnni_16(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
                       const T* a, const T* b, float* c, Vnni vnni) {
  TORCH_CHECK(packs(vnni), "flash_metal: a plain-VNNI product needs a VNNI mode");
  TORCH_CHECK(N <= ldb && ldb <= kPlainVnniMaxLd && K % 2 == 0,
              "flash_metal: a plain-VNNI B operand needs N <= ldb <= ", kPlainVnniMaxLd,
              " (the widths measured on AMX) and an even K; got N ", N, ", ldb ", ldb, ", K ", K);
  if (vnni == Vnni::Emulated) return emulated_gemm(M, N, K, lda, ldb, ldc, add_c, a, b, c);
#ifdef FLASH_METAL_HAS_BRGEMM
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_c, a, b, c, true);
#else
  TORCH_CHECK(false, "flash_metal: brgemm is unavailable in this torch");
#endif
}

}  // namespace

void tile_gemm_vnni(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
                    const c10::BFloat16* a, const c10::BFloat16* b, float* c, Vnni vnni) {
  tile_gemm_vnni_16(M, N, K, lda, ldb, ldc, add_c, a, b, c, vnni);
}
void tile_gemm_vnni(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
                    const c10::Half* a, const c10::Half* b, float* c, Vnni vnni) {
  tile_gemm_vnni_16(M, N, K, lda, ldb, ldc, add_c, a, b, c, vnni);
}
void tile_gemm_vnni(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, const float*, const float*, float*,
                    Vnni) {
  TORCH_CHECK(false, "flash_metal: a float32 block product has no VNNI form");
}

void tile_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
               const c10::BFloat16* a, const c10::BFloat16* b, float* c, Vnni vnni) {
  tile_gemm_16(M, N, K, lda, ldb, ldc, add_c, a, b, c, vnni);
}
void tile_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
               const c10::Half* a, const c10::Half* b, float* c, Vnni vnni) {
  tile_gemm_16(M, N, K, lda, ldb, ldc, add_c, a, b, c, vnni);
}
void tile_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c, const float* a,
               const float* b, float* c, Vnni vnni) {
  TORCH_CHECK(vnni == Vnni::Off, "flash_metal: a float32 block product has no VNNI form");
#ifdef FLASH_METAL_HAS_BRGEMM
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_c, a, b, c, false);
#else
  (void)M, (void)N, (void)K, (void)lda, (void)ldb, (void)ldc, (void)add_c, (void)a, (void)b, (void)c;
  TORCH_CHECK(false, "flash_metal: brgemm is unavailable in this torch");
#endif
}

void pack_block(int64_t K, int64_t N, int64_t ld_in, int64_t ld_out, at::ScalarType dtype, const void* in, void* out,
                Vnni vnni) {
  TORCH_CHECK(vnni != Vnni::Off, "flash_metal: pack_block called without a VNNI mode");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "flash_metal: pack_b takes 16-bit operands");
  TORCH_CHECK(N <= ld_out, "flash_metal: a VNNI block of ", N, " columns needs ld_out >= N (got ", ld_out,
              "): with N > ld_out ATen writes a blocked layout the products do not read");
  if (vnni == Vnni::Emulated)
    return emulated_pack_block(K, N, ld_in, ld_out, static_cast<const uint16_t*>(in), static_cast<uint16_t*>(out));
#ifdef FLASH_METAL_HAS_BRGEMM
  at::native::cpublas::pack(K, N, ld_in, ld_out, dtype, dtype, in, out);
#else
  TORCH_CHECK(false, "flash_metal: cpublas::pack is unavailable in this torch");
#endif
}

void pack_b(int64_t K, int64_t N, int64_t ld_in, at::ScalarType dtype, const void* in, void* out, Vnni vnni) {
  const auto* src = static_cast<const uint16_t*>(in);  // both 16-bit dtypes: 2-byte elements
  auto* dst = static_cast<uint16_t*>(out);
  for (int64_t c0 = 0; c0 < N; c0 += kPackBlock) {
    const int64_t nb = std::min(kPackBlock, N - c0);
    pack_block(K, nb, ld_in, pack_block_ld(nb), dtype, src + c0, dst + K * c0, vnni);
  }
}

void tile_release(Vnni vnni) {
#ifdef FLASH_METAL_HAS_BRGEMM
  if (vnni == Vnni::Aten) at::native::cpublas::brgemm_release(true);
#else
  (void)vnni;
#endif
}

namespace {

std::tuple<std::string, std::string, bool> cpu_path_info(at::ScalarType dtype, bool backward) {
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                    "flash_metal.cpu_path_info: dtype must be float32, float16 or bfloat16; got ", dtype);
  const PathChoice pc = choose_cpu_path(dtype, backward);
  return {pc.path == CpuPath::Brgemm ? "brgemm" : "vector", describe_cpu_path(pc, dtype, backward), packs(pc.vnni)};
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

// b (K x N, bfloat16/float16, K even) packed, flattened: lets the tests
// check the VNNI layout brgemm_tiles.h / brgemm_backward.h rely on, and that
// the emulation refuses what ATen refuses. ld_out None: pack_b (the blocked
// layout, packed_elems(K, N) elements); ld_out given: one pack_block call with
// that ld_out (K x ld_out elements), as ATen's pack is called. emulated: this
// project's pack (any CPU); else ATen's (only where could_pack).
at::Tensor cpu_vnni_pack(const at::Tensor& b, bool emulated, std::optional<int64_t> ld_out) {
  TORCH_CHECK_VALUE(b.dim() == 2 && b.device().is_cpu() && b.size(0) % 2 == 0 &&
                        (b.scalar_type() == at::kBFloat16 || b.scalar_type() == at::kHalf),
                    "flash_metal.cpu_vnni_pack: b must be a 2-D CPU bfloat16/float16 tensor with an even row count");
  TORCH_CHECK_VALUE(!ld_out.has_value() || (*ld_out >= b.size(1) && *ld_out <= 4096),
                    "flash_metal.cpu_vnni_pack: ld_out must be at least b's column count (", b.size(1),
                    ") and at most 4096; got ", ld_out.value_or(0));
  TORCH_CHECK(emulated || packable_16(b.scalar_type()),
              "flash_metal.cpu_vnni_pack: ATen cannot pack this dtype for the matrix units on this CPU");
  const at::Tensor in = b.contiguous();
  const int64_t K = b.size(0), N = b.size(1);
  const Vnni mode = emulated ? Vnni::Emulated : Vnni::Aten;
  at::Tensor out = at::empty({ld_out.has_value() ? K * *ld_out : packed_elems(K, N)}, b.options());
  if (ld_out.has_value())
    pack_block(K, N, N, *ld_out, b.scalar_type(), in.const_data_ptr(), out.mutable_data_ptr(), mode);
  else
    pack_b(K, N, N, b.scalar_type(), in.const_data_ptr(), out.mutable_data_ptr(), mode);
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
  // CPU kernel calls so far per path: [fwd vector, fwd brgemm, bwd vector, bwd brgemm,
  // fwd brgemm with emulated VNNI, bwd the same, emulated tile products, fwd brgemm in the column form].
  m.def("cpu_path_counts() -> int[]", &flash_metal::cpu::cpu_path_counts);
  m.def("cpu_features() -> (str[] names, int[] values)", &flash_metal::cpu::cpu_features_op);
  m.def("cpu_vnni_pack(Tensor b, bool emulated=False, int? ld_out=None) -> Tensor", &flash_metal::cpu::cpu_vnni_pack);
}
