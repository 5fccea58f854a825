// Run-time choice of the CPU kernel's tile-product path (issue 22), and the
// thin typed wrappers over PyTorch's block GEMM (at::native::cpublas::brgemm)
// that the "brgemm" path calls.
//
// Two paths compute the same online-softmax FlashAttention:
//   vector  the register-tiled float32 micro-kernels (forward_tiles.h,
//           backward_tiles.h): every dtype is widened to float32, both tile
//           products run on the FMA units. Compiled for the build machine.
//   brgemm  16-bit inputs only: Q.K^T and P.V run through ATen's brgemm on
//           the 16-bit operands with float32 accumulation, P rounded to the
//           input dtype first (as FlashAttention does). Where ATen can drive
//           the matrix units (cpublas::could_pack(dtype): AMX-BF16 for
//           bfloat16, AMX-FP16 for float16, with oneDNN's ukernels) B operands
//           are packed pair-interleaved (VNNI) and the products run on AMX;
//           elsewhere ATen's fallback (its mixed-precision gemm) serves the
//           same calls, which is how this machine without AMX tests the path.
// The choice: FLASH_METAL_CPU_PATH = auto (default) | vector | brgemm,
// read at every call. auto takes brgemm only where it is expected to win:
// a 16-bit dtype whose B operands ATen can pack for the matrix units;
// otherwise vector (on AVX2 and plain AVX-512 the FMA path is today's
// measured one). The backward's brgemm products (attention_backward_cpu.cpp)
// do not pack for AMX yet: auto keeps the backward on vector, and forced
// brgemm runs it with plain (non-VNNI) calls. brgemm forced on float32 runs vector (documented
// fallback: the path exists for 16-bit tiles); forced where this torch has
// no brgemm (< 2.6) it is an error.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <string>

namespace flash_metal {
namespace cpu {

enum class CpuPath { Vector = 0, Brgemm = 1 };

// Why a path was chosen: a code, so that choosing costs no allocation on
// every kernel call; the sentence is built only when introspection asks
// (describe_cpu_path, for cpu_path_info / explain).
enum class PathWhy : uint8_t {
  ForcedVector,         // FLASH_METAL_CPU_PATH=vector
  ForcedBrgemmFloat32,  // =brgemm on float32: vector (the path is for 16-bit tiles)
  ForcedBrgemm,         // =brgemm on a 16-bit dtype
  AutoBackward16,       // auto, backward, 16-bit: vector (no VNNI packing in the backward yet)
  AutoMatrixUnits,      // auto, forward, 16-bit, ATen can pack for AMX: brgemm
  AutoNoMatrixUnits,    // auto, 16-bit, no AMX for the dtype: vector
  AutoFloat32,          // auto, float32: vector
};

struct PathChoice {
  CpuPath path = CpuPath::Vector;
  bool vnni = false;  // brgemm with pair-interleaved B operands (matrix units)
  PathWhy why = PathWhy::AutoFloat32;
};

// The path a call of this dtype takes now (reads FLASH_METAL_CPU_PATH; no
// allocation unless the variable holds a bad value, which is an error).
// backward: the backward's products (same rule; named in the reason).
PathChoice choose_cpu_path(at::ScalarType dtype, bool backward);
// The reason of a choice as a sentence, e.g. "forward bfloat16: vector (auto: ...)".
std::string describe_cpu_path(const PathChoice& pc, at::ScalarType dtype, bool backward);

// Counts one call of a kernel on `path` (forward or backward), for tests.
void count_cpu_path(CpuPath path, bool backward);

// The CPU's features as cpuid and the OS report them (x86-64; all false
// elsewhere), for the benchmarks' labels and the reasons above.
struct CpuFeatures {
  bool avx2 = false, fma = false, avx512f = false, avx512_bf16 = false, avx512_fp16 = false;
  bool amx_tile = false, amx_bf16 = false, amx_fp16 = false;
};
const CpuFeatures& cpu_features();

// ---- ATen's block GEMM (matrix_units.cpp; callable only when
// brgemm_compiled()): C (M x N, ldc) = [C +] A (M x K, lda) . B (K x N, ldb),
// float32 C. vnni: B was packed by pack_b (rows taken in pairs).
bool brgemm_compiled();
void tile_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
               const c10::BFloat16* a, const c10::BFloat16* b, float* c, bool vnni);
void tile_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
               const c10::Half* a, const c10::Half* b, float* c, bool vnni);
// float32: never chosen (the path is for 16-bit tiles); present so the
// kernels' templates instantiate for every dtype. Calls ATen's float brgemm.
void tile_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c, const float* a,
               const float* b, float* c, bool vnni);
// B (K x N, row stride ld_in) -> the VNNI layout brgemm reads with ldb = N:
// out[(k / 2) * 2N + 2n + k % 2] = in[k * ld_in + n] (K even). Only where
// could_pack(dtype).
void pack_b(int64_t K, int64_t N, int64_t ld_in, at::ScalarType dtype, const void* in, void* out);
// End of a thread's brgemm work (frees the AMX tile state; no-op without vnni).
void tile_release(bool vnni);

}  // namespace cpu
}  // namespace flash_metal
