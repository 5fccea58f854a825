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
// a 16-bit dtype whose B operands ATen can pack for the matrix units
// (could_pack), forward and backward alike; otherwise vector (on AVX2 and
// plain AVX-512 the FMA path is today's measured one). brgemm forced on
// float32 runs vector (documented fallback: the path exists for 16-bit
// tiles); forced where this torch has no brgemm (< 2.6) it is an error.
//
// The VNNI mode (enum Vnni, carried in PathChoice and passed to every
// pack_b / tile_gemm call, so an ATen-packed operand never meets the
// emulated product): FLASH_METAL_CPU_VNNI = auto (default) | emulate | off.
//   auto     brgemm packs B with ATen (Vnni::Aten) where could_pack, else
//            runs ATen's plain calls (Vnni::Off);
//   emulate  a test seam: every brgemm choice packs B pair-interleaved with
//            this project's scalar pack and multiplies with its scalar
//            gemm (Vnni::Emulated), on any CPU, and auto takes brgemm for
//            16-bit dtypes as if the matrix units were there. So the
//            kernels' VNNI operand code (the even pads, the packed leading
//            dimensions, the once-per-block packs) runs in tests on every
//            x86-64 machine. Slow by design (scalar products): never chosen
//            unless asked for;
//   off      brgemm never packs (Vnni::Off; ATen's non-VNNI calls, even on
//            AMX), and auto keeps vector.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <limits>
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
  AutoMatrixUnits,      // auto, 16-bit, ATen can pack for AMX: brgemm + Vnni::Aten
  AutoEmulated,         // auto, 16-bit, FLASH_METAL_CPU_VNNI=emulate: brgemm + Vnni::Emulated
  AutoVnniOff,          // auto, 16-bit, FLASH_METAL_CPU_VNNI=off: vector
  AutoNoMatrixUnits,    // auto, 16-bit, no AMX for the dtype: vector
  AutoFloat32,          // auto, float32: vector
  AutoSplitBf16,        // auto, float16 forward, AMX-BF16 without AMX-FP16: brgemm + Aten, split
};

// How brgemm's B operands are laid out and who multiplies them (see above).
enum class Vnni : uint8_t {
  Off,       // plain row-major B; ATen's brgemm (its fallback GEMM without AMX)
  Aten,      // B packed by ATen's cpublas::pack; ATen's brgemm on the matrix units
  Emulated,  // B packed by this project's scalar pack; its scalar gemm (test seam)
};
// Whether B operands are packed pair-interleaved (and every reduction dim padded to even).
inline bool packs(Vnni v) { return v != Vnni::Off; }

// FLASH_METAL_CPU_PATH and FLASH_METAL_CPU_VNNI as read (allocation-free).
enum class PathMode : uint8_t { Auto, Vector, Brgemm };
enum class VnniMode : uint8_t { Auto, Emulate, Off };

struct PathChoice {
  CpuPath path = CpuPath::Vector;
  Vnni vnni = Vnni::Off;  // brgemm only: B operands' layout and the product's implementation
  PathWhy why = PathWhy::AutoFloat32;
  // float16 forward on the bfloat16 matrix units, each operand split into two
  // bfloat16s (brgemm_split.h): where float16 itself has no AMX (no AMX-FP16)
  // and the brgemm path packs (vnni Aten or Emulated).
  bool split = false;
};

// The rule itself, a pure function (the tests reach it through the two
// variables; could_pack cannot be faked): sixteen = bfloat16/float16,
// packable = could_pack(dtype). The same for forward and backward.
PathChoice choose_path_rule(PathMode mode, VnniMode vnni, bool sixteen, bool packable);
// The path a call of this dtype takes now (reads FLASH_METAL_CPU_PATH and
// FLASH_METAL_CPU_VNNI; no allocation unless a variable holds a bad value,
// which is an error). backward: named in the reason.
PathChoice choose_cpu_path(at::ScalarType dtype, bool backward);
// The reason of a choice as a sentence, e.g. "forward bfloat16: vector (auto: ...)".
std::string describe_cpu_path(const PathChoice& pc, at::ScalarType dtype, bool backward);

// Counts one call of a kernel on its path (forward or backward), and one
// more in the pass's emulated-VNNI slot when the choice emulates, for tests.
void count_cpu_path(const PathChoice& pc, bool backward);

// Counts one forward call that took the brgemm path's column form (brgemm_cols.h).
void count_cpu_cols_form();
// Counts one float32 backward query block that took the first pass (backward_precise.h).
void count_cpu_renormalized_block();
// Counts one float16 forward call that took the split bfloat16 form (brgemm_split.h).
void count_cpu_split_form();
// Counts one forward call that spread its items' keys over several splits (key_split.h).
void count_cpu_key_split();

// The CPU's features as cpuid and the OS report them (x86-64; all false
// elsewhere), for the benchmarks' labels and the reasons above.
struct CpuFeatures {
  bool avx2 = false, fma = false, avx512f = false, avx512_bf16 = false, avx512_fp16 = false;
  bool amx_tile = false, amx_bf16 = false, amx_fp16 = false;
};
const CpuFeatures& cpu_features();

// ---- The VNNI layout, in column blocks of at most 64 (ATen's pack limits).
// ATen's cpublas::pack is oneDNN's ukernel transform, whose destination
// leading dimension (ld_out) must be 16, 32, 48 or 64 (oneDNN's
// doc/ukernel/operations/transform.md, "Implementation limitations"; measured
// on a Sapphire-Rapids-class AMX Xeon with torch 2.11 / oneDNN 3.10: every
// other ld_out raises "could not create a BRGeMM ukernel packing B object",
// any ld_in >= N works, and with N > ld_out it writes a blocked layout of its
// own). PyTorch's CPU flash attention packs in 64-column blocks for the same
// reason (FlashAttentionKernel.cpp, packb_size). So a packed B operand of K
// rows and N columns is a sequence of column blocks: block b holds columns
// [64b, 64b + nb), nb = min(64, N - 64b), packed with ld_out = nb rounded up
// to 16 (pad columns zero) and stored from element K * 64b; pair p of its
// rows starts at p * 2 * ld_out. The products run block by block (brgemm
// itself takes any N <= ldb, measured on the same machine). Total size:
// K * round_up(N, 16) elements (packed_elems).
constexpr int64_t kPackBlock = 64;
// ld_out values ATen's pack accepts (oneDNN's transform), and the one a block of nb columns uses.
inline bool pack_ld_ok(int64_t ld_out) { return ld_out == 16 || ld_out == 32 || ld_out == 48 || ld_out == 64; }
inline int64_t pack_block_ld(int64_t nb) { return (nb + 15) / 16 * 16; }
inline int64_t packed_elems(int64_t K, int64_t N) { return K * pack_block_ld(N); }

// ---- The block GEMM (matrix_units.cpp; Off / Aten callable only when
// brgemm_compiled()): C (M x N, ldc) = [C +] A (M x K, lda) . B (K x N),
// float32 C. vnni Off: B row-major, row stride ldb. Aten / Emulated: B was
// packed by pack_b with the same mode and the same N (ldb must equal N), in
// the column blocks above, K even.
bool brgemm_compiled();
void tile_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
               const c10::BFloat16* a, const c10::BFloat16* b, float* c, Vnni vnni);
void tile_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
               const c10::Half* a, const c10::Half* b, float* c, Vnni vnni);
// float32: never chosen (the path is for 16-bit tiles); present so the
// kernels' templates instantiate for every dtype. ATen's float brgemm, Off only.
void tile_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c, const float* a,
               const float* b, float* c, Vnni vnni);
// The same product with B in the plain VNNI layout this project packs itself
// (brgemm_cols.h): pair p of B's rows at b + p * 2 * ldb, element (k, n) at
// b[(k / 2) * 2 * ldb + 2 * n + k % 2], N <= ldb <= kPlainVnniMaxLd, K even.
// ATen's brgemm reads exactly this layout for any N <= ldb: measured on the
// AMX Xeon (issue 39) for N 8 to 256 and ldb N, 64 and 128, M 1 to 96 and
// K 2 to 576, every result exact. Nothing wider was measured, so the
// emulation refuses an ldb above 256 as the real path would be untested
// there. vnni Aten or Emulated only.
constexpr int64_t kPlainVnniMaxLd = 256;
void tile_gemm_vnni(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
                    const c10::BFloat16* a, const c10::BFloat16* b, float* c, Vnni vnni);
void tile_gemm_vnni(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
                    const c10::Half* a, const c10::Half* b, float* c, Vnni vnni);
void tile_gemm_vnni(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
                    const float* a, const float* b, float* c, Vnni vnni);  // never called: an error
// B (K x N, row stride ld_in, K even) -> the blocked VNNI layout above
// (packed_elems(K, N) elements at out). vnni Aten: ATen's pack, one call per
// block (only where could_pack(dtype)); Emulated: this project's scalar
// pack, which refuses what ATen's refuses (anywhere). Off is an error.
void pack_b(int64_t K, int64_t N, int64_t ld_in, at::ScalarType dtype, const void* in, void* out, Vnni vnni);
// One block: B (K x N, row stride ld_in) packed with this ld_out, as ATen's
// pack is called (the emulation raises ATen's error for an ld_out ATen
// refuses; both modes refuse N > ld_out, a layout the products do not read).
void pack_block(int64_t K, int64_t N, int64_t ld_in, int64_t ld_out, at::ScalarType dtype, const void* in, void* out,
                Vnni vnni);
// End of a thread's brgemm work (frees the AMX tile state with Aten; no-op otherwise).
void tile_release(Vnni vnni);

// Emulated mode only: fills a staging buffer with NaN before the kernel
// writes an operand into it, so a pad the code forgets to zero reaches the
// product as NaN (0 * NaN = NaN) and the tests see it. No-op otherwise.
template <typename T>
inline void poison_if_emulated(T* p, int64_t n, Vnni vnni) {
  if (vnni == Vnni::Emulated)
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
}

}  // namespace cpu
}  // namespace flash_metal
