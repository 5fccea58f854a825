// Instantiations of the MSL 4 kernels (Metal 4 tensor operations, issue 21),
// a library of their own: Apple compiles this file with -std=metal4.0, the
// emulator with compile_library(..., msl=4). attention.metal (MSL 3.1) never
// includes it, so the portable library builds with toolchains and OSes that
// have no tensor ops. Host names encode every template parameter and must
// match the names csrc/metal/launch.cpp builds:
//   flash_attention_prefill_mpp_<dtype>_d<D>_bq<BQ>_bk<BK>
//   flash_attention_prefill_mpp_dsplit_<dtype>_d<D>_bq<BQ>_bk<BK>_wn<WN> (BQ 32 and 64)
//   flash_backward_mpp_dq_<dtype>_d<D>_bq<BQ>_bk<BK>
//   flash_backward_mpp_dkdv_<dtype>_d<D>_bk<BKV>_bq<BQ>
//   flash_backward_mpp_dsplit_dq_<dtype>_d<D>_bq<BQ>_bk<BK>_wn<WN>
//   flash_backward_mpp_dsplit_dkdv_<dtype>_d<D>_bk<BKV>_bq<BQ>_wn<WN>
// and, for a v head dim of its own (MLA), _dqk<D>_dv<DV> in place of _d<D>.
//
// setup.py compiles this file (every shaders/*_mpp.metal) into a library of
// its own, flash_metal_mpp.metallib, with -std=metal4.0 and a 26.2
// deployment target (PyTorch #191794), behind an MSL 4 toolchain probe; the
// guard below keeps it empty under any older language version, so a
// Metal 3.1 compile of it (the emulator's MSL 3 checks) sees no kernels.
#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 400 && defined(__HAVE_TENSOR__)
#include "tensor_ops/attention_mpp_common.h"  // first: the MSL 4 headers all include it
#include "tensor_ops/attention_prefill_mpp.h"
#include "tensor_ops/attention_prefill_mpp_dsplit.h"
#include "tensor_ops/attention_backward_mpp.h"
#include "tensor_ops/attention_backward_mpp_dsplit.h"

// The one instantiation macro: a host name plus the template it names.
#define FM_MPP_INSTANTIATE(name, ...) \
  template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;

// 64 query rows (4 SIMD-groups of 16) x 32 keys per block: MLX NAX's BQ and
// BK (the host's choice, csrc/metal/routing.cpp). D: the head dims the
// tensor-op path serves, exactly (no padding bucket yet).
#define FM_PREFILL_MPP(tname, T, D)                                                      \
  FM_MPP_INSTANTIATE("flash_attention_prefill_mpp_" #tname "_d" #D "_bq64_bk32",       \
                     flash_attention_prefill_mpp<T, D, D, 64, 32>)

// DeepSeek-V2/V3's and Kimi's MLA pair, q/k 192 and v 128 (issue 20
// section 2): the same blocks; 28,928 bytes of threadgroup memory (Q's
// staging is 192 wide; V is not staged).
#define FM_PREFILL_MPP_MLA(tname, T, D, DV)                                                       \
  FM_MPP_INSTANTIATE("flash_attention_prefill_mpp_" #tname "_dqk" #D "_dv" #DV "_bq64_bk32",    \
                     flash_attention_prefill_mpp<T, D, DV, 64, 32>)

#define FM_PREFILL_MPP_ALL_D(tname, T) \
  FM_PREFILL_MPP(tname, T, 64)         \
  FM_PREFILL_MPP(tname, T, 96)         \
  FM_PREFILL_MPP(tname, T, 128)         \
  FM_PREFILL_MPP_MLA(tname, T, 192, 128)

// D = 256 split along D (attention_prefill_mpp_dsplit.h): 32 query rows
// (2 row groups of 16, each a pair of SIMD-groups owning 128 features
// apiece) x 32 keys; 28,928 bytes of threadgroup memory (the host's table:
// csrc/metal/plan_detail.h, tensor_ops_dsplit_threadgroup_bytes).
// The 64-row variant (the same header): 64 query rows (4 row groups, 8
// SIMD-groups, 256 threads) x 16 keys, Q in registers, two slots of
// partials; 20,992 bytes (tensor_ops_dsplit_wide_threadgroup_bytes). Why
// 16 keys: the register budget (csrc/metal/plan_detail.h).
#define FM_PREFILL_MPP_DSPLIT(tname, T)                                                          \
  FM_MPP_INSTANTIATE("flash_attention_prefill_mpp_dsplit_" #tname "_d256_bq32_bk32_wn2",       \
                     flash_attention_prefill_mpp_dsplit<T, 256, 32, 32, 2>)                    \
  FM_MPP_INSTANTIATE("flash_attention_prefill_mpp_dsplit_" #tname "_d256_bq64_bk16_wn2",       \
                     flash_attention_prefill_mpp_dsplit_wide<T, 256, 64, 16, 2>)

// The backward (attention_backward_mpp.h): 32 keys per dQ block and 32
// query rows per dK/dV block (one lane per streamed query fills the
// stats); as many SIMD-groups of 16 rows (4, else 2) as fit 32 KiB of
// threadgroup memory: dQ 4 at D 64 / 96 (21,504 / 29,696 bytes), 2 at 128
// (18,944); dK/dV 4 at every D (16,896 / 20,992 / 25,088: the shared Q / dO
// block and four SIMD-groups' P^T and dS^T).
// The host's table is csrc/metal/plan_detail.h, tensor_ops_backward_rows.
#define FM_BACKWARD_MPP(tname, T, D, BQ, BKV)                                              \
  FM_MPP_INSTANTIATE("flash_backward_mpp_dq_" #tname "_d" #D "_bq" #BQ "_bk32",            \
                     flash_backward_mpp_dq<T, D, D, BQ, 32>)                               \
  FM_MPP_INSTANTIATE("flash_backward_mpp_dkdv_" #tname "_d" #D "_bk" #BKV "_bq32",         \
                     flash_backward_mpp_dkdv<T, D, D, BKV, 32>)

// The MLA pair (192, 128): dQ on 2 SIMD-groups (4 would need 46,080 bytes:
// Q 16 x 192 and dO 16 x 128 per SIMD-group; 2 take 23,040), dK/dV on 4
// (29,184: the shared Q 32 x 192 and dO 32 x 128 block).
#define FM_BACKWARD_MPP_MLA(tname, T, D, DV, BQ, BKV)                                              \
  FM_MPP_INSTANTIATE("flash_backward_mpp_dq_" #tname "_dqk" #D "_dv" #DV "_bq" #BQ "_bk32",        \
                     flash_backward_mpp_dq<T, D, DV, BQ, 32>)                                      \
  FM_MPP_INSTANTIATE("flash_backward_mpp_dkdv_" #tname "_dqk" #D "_dv" #DV "_bk" #BKV "_bq32",     \
                     flash_backward_mpp_dkdv<T, D, DV, BKV, 32>)

#define FM_BACKWARD_MPP_ALL_D(tname, T) \
  FM_BACKWARD_MPP(tname, T, 64, 64, 64) \
  FM_BACKWARD_MPP(tname, T, 96, 64, 64) \
  FM_BACKWARD_MPP(tname, T, 128, 32, 64) \
  FM_BACKWARD_MPP_MLA(tname, T, 192, 128, 32, 64)

// The backward at D = 256 split along D (attention_backward_mpp_dsplit.h):
// dQ on one pair (16 rows, 32 keys per block, 27,264 bytes), dK/dV on two
// pairs (32 keys, 16 queries per streamed block, 28,928 bytes); the host's
// table is csrc/metal/plan_detail.h, tensor_ops_dsplit_backward_bytes.
#define FM_BACKWARD_MPP_DSPLIT(tname, T)                                                          \
  FM_MPP_INSTANTIATE("flash_backward_mpp_dsplit_dq_" #tname "_d256_bq16_bk32_wn2",               \
                     flash_backward_mpp_dsplit_dq<T, 256, 32, 2>)                                 \
  FM_MPP_INSTANTIATE("flash_backward_mpp_dsplit_dkdv_" #tname "_d256_bk32_bq16_wn2",             \
                     flash_backward_mpp_dsplit_dkdv<T, 256, 32, 16, 2>)

// An explicit instantiation with an unqualified name sits in the template's
// own namespace (C++ [temp.explicit]).
namespace flash_metal {
FM_PREFILL_MPP_ALL_D(float16, half)
FM_PREFILL_MPP_ALL_D(bfloat16, bfloat)
FM_PREFILL_MPP_DSPLIT(float16, half)
FM_PREFILL_MPP_DSPLIT(bfloat16, bfloat)
FM_BACKWARD_MPP_ALL_D(float16, half)
FM_BACKWARD_MPP_ALL_D(bfloat16, bfloat)
FM_BACKWARD_MPP_DSPLIT(float16, half)
FM_BACKWARD_MPP_DSPLIT(bfloat16, bfloat)
}  // namespace flash_metal
#endif  // MSL 4 with tensors
