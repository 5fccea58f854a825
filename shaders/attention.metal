// Instantiations of every attention kernel; the templates live in the .h
// files. One file, so the metallib and the MPS host's runtime-compile
// fallback (which compiles this file with its headers inlined) hold the same
// kernels. Host names encode every template parameter, and must match the
// names csrc/metal/launch.cpp builds:
//   flash_attention_untiled_<dtype>_d<DMAX>_t<THREADS>
//   flash_attention_tiled_<dtype>_d<DMAX>_bk<BK>_t<THREADS>
//   flash_attention_prefill_<dtype>_d<DMAX>_bq<BQ>_bk<BK>_wm<WM>
//   flash_attention_prefill_splitd_<dtype>_d<D>_bq<BQ>_bk<BK>_wm<WM> (D_qk = D_v = D = 512 only), and
//   flash_attention_prefill_splitd_<dtype>_dqk<DQK>_dv<DV>_bq<BQ>_bk<BK>_wm<WM> where D_qk != D_v ((576, 512), (256, 512))
//   flash_decode_<dtype>_d<DMAX>, flash_decode_split_<dtype>_d<DMAX>, flash_decode_merge_<dtype>_d<DMAX>
//   (DMAX also 512 and 576: decode only)
//   flash_decode_quant_<dtype>_d<DMAX>, flash_decode_quant_split_<dtype>_d<DMAX> (quantized KV caches, DMAX <= 256)
//   flash_backward_dq_<dtype>_d<DMAX>_bq<BQ>_bk<BK>_wm<WM>_ds<DSPLIT>,
//   flash_backward_dkdv_<dtype>_d<DMAX>_bq<BQ>_bk<BK>_wm<WM>_ds<DSPLIT>
//   flash_backward_splitd_dq_<dtype>_d<DMAX>_bq<BQ>_bk<BK>_wm<WM>,
//   flash_backward_splitd_dkdv_<dtype>_d<DMAX>_bq<BQ>_bk<BK>_wm<WM> (DMAX 512 only)
//   flash_sinks_grad (float32 only: lse, Delta and the sinks' gradient)
#include "post/attention_untiled.h"
#include "post/attention_tiled.h"
#include "prefill/attention_prefill.h"
#include "prefill/attention_prefill_splitd.h"
#include "decode/attention_decode.h"
#include "decode/attention_decode_quant.h"
#include "backward/attention_backward_dq.h"
#include "backward/attention_backward_dkdv.h"
#include "backward/attention_backward_splitd.h"
#include "backward/attention_sinks.h"

// The one instantiation macro: a host name plus the template it names; the
// kernel's signature comes from decltype, so it is never repeated here.
#define FM_INSTANTIATE(name, ...) \
  template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;

// The post's configuration: 32 threads per group, 16 keys per tile.
#define FM_POST_KERNELS(tname, T, D)                                                   \
  FM_INSTANTIATE("flash_attention_untiled_" #tname "_d" #D "_t32",                     \
                 flash_attention_untiled<T, D, 32>)                                    \
  FM_INSTANTIATE("flash_attention_tiled_" #tname "_d" #D "_bk16_t32",                  \
                 flash_attention_tiled<T, D, 16, 32>)

#define FM_POST_KERNELS_ALL_D(tname, T) \
  FM_POST_KERNELS(tname, T, 32)         \
  FM_POST_KERNELS(tname, T, 64)         \
  FM_POST_KERNELS(tname, T, 128)        \
  FM_POST_KERNELS(tname, T, 256)

// The FlashAttention-2 forward's block sizes per (dtype, bucket), as the
// routing function (choose_metal_kernel in csrc/metal/routing.cpp) chooses
// and explains them: 32 query rows (16 at D = 256, and float32 at 192) in 8-row groups of
// WM * 8 / BQ SIMD-groups (feature parts of O), keys per block within the
// register budget and 8 resident SIMD-groups per core.
#define FM_PREFILL(tname, T, D, BQ, BK, WM)                                                 \
  FM_INSTANTIATE("flash_attention_prefill_" #tname "_d" #D "_bq" #BQ "_bk" #BK "_wm" #WM, \
                 flash_attention_prefill<T, D, BQ, BK, WM>)

#define FM_PREFILL_HALF_ALL_D(tname, T) \
  FM_PREFILL(tname, T, 32, 32, 32, 4)   \
  FM_PREFILL(tname, T, 64, 32, 32, 4)   \
  FM_PREFILL(tname, T, 72, 32, 32, 4)   \
  FM_PREFILL(tname, T, 80, 32, 32, 4)   \
  FM_PREFILL(tname, T, 96, 32, 32, 4)   \
  FM_PREFILL(tname, T, 128, 32, 16, 4)  \
  FM_PREFILL(tname, T, 192, 32, 8, 4)   \
  FM_PREFILL(tname, T, 256, 16, 8, 4)

#define FM_PREFILL_FLOAT_ALL_D(tname, T) \
  FM_PREFILL(tname, T, 32, 32, 32, 4)    \
  FM_PREFILL(tname, T, 64, 32, 16, 4)    \
  FM_PREFILL(tname, T, 72, 32, 16, 4)    \
  FM_PREFILL(tname, T, 80, 32, 16, 4)    \
  FM_PREFILL(tname, T, 96, 32, 8, 4)     \
  FM_PREFILL(tname, T, 128, 32, 16, 8)   \
  FM_PREFILL(tname, T, 192, 16, 16, 8)   \
  FM_PREFILL(tname, T, 256, 16, 8, 8)

// The split-D forward at head dim 512 (attention_prefill_splitd.h, issue 20
// section 3): 8 query rows x 32 keys on 8 SIMD-groups of 64 features each,
// the blocks csrc/metal/families/prefill_splitd.cpp plans and explains (the header
// says why these). Three per dtype: D_qk = D_v = 512, and
// MLA's pairs (issue 20 section 2) name both dims: (576, 512), the
// absorbed-MLA latent (and its decode, packed over the query heads:
// fc_pack_gqa), and (256, 512).
#define FM_PREFILL_SPLITD(tname, T)                                                          \
  FM_INSTANTIATE("flash_attention_prefill_splitd_" #tname "_d512_bq8_bk32_wm8",               \
                 flash_attention_prefill_splitd<T, 512, 512, 8, 32, 8>)                       \
  FM_INSTANTIATE("flash_attention_prefill_splitd_" #tname "_dqk576_dv512_bq8_bk32_wm8",       \
                 flash_attention_prefill_splitd<T, 576, 512, 8, 32, 8>)                       \
  FM_INSTANTIATE("flash_attention_prefill_splitd_" #tname "_dqk256_dv512_bq8_bk32_wm8",       \
                 flash_attention_prefill_splitd<T, 256, 512, 8, 32, 8>)

// The decode kernels (Nq <= 8): one pass, and the split-KV pair.
#define FM_DECODE(tname, T, D)                                                   \
  FM_INSTANTIATE("flash_decode_" #tname "_d" #D, flash_decode<T, D>)             \
  FM_INSTANTIATE("flash_decode_split_" #tname "_d" #D, flash_decode_split<T, D>) \
  FM_INSTANTIATE("flash_decode_merge_" #tname "_d" #D, flash_decode_merge<T, D>)

#define FM_DECODE_ALL_D(tname, T) \
  FM_DECODE(tname, T, 32)         \
  FM_DECODE(tname, T, 64)         \
  FM_DECODE(tname, T, 72)         \
  FM_DECODE(tname, T, 80)         \
  FM_DECODE(tname, T, 96)         \
  FM_DECODE(tname, T, 128)        \
  FM_DECODE(tname, T, 192)        \
  FM_DECODE(tname, T, 256)        \
  FM_DECODE(tname, T, 512)        \
  FM_DECODE(tname, T, 576)

// The quantized-cache decode (issue 44, decode/attention_decode_quant.h):
// one pass and split pass 1 (the merge is the native one), buckets up to 256.
#define FM_DECODE_QUANT(tname, T, D)                                                 \
  FM_INSTANTIATE("flash_decode_quant_" #tname "_d" #D, flash_decode_quant<T, D>)     \
  FM_INSTANTIATE("flash_decode_quant_split_" #tname "_d" #D, flash_decode_quant_split<T, D>)

#define FM_DECODE_QUANT_ALL_D(tname, T) \
  FM_DECODE_QUANT(tname, T, 32)         \
  FM_DECODE_QUANT(tname, T, 64)         \
  FM_DECODE_QUANT(tname, T, 72)         \
  FM_DECODE_QUANT(tname, T, 80)         \
  FM_DECODE_QUANT(tname, T, 96)         \
  FM_DECODE_QUANT(tname, T, 128)        \
  FM_DECODE_QUANT(tname, T, 192)        \
  FM_DECODE_QUANT(tname, T, 256)

// Why two decode-only buckets above 256 (issue 20; the prefill template and
// the backward stop at 256, csrc/metal/plan.h kDecodeHeadDimBuckets; the
// split-D forward above serves causal D = 512): 512 serves Gemma's
// global layers (D = D_v = 512: D == DMAX, so the lanes' 16-feature runs are
// vector loads, fc_dense, and 16 values per lane per slice rather than 18);
// 576 serves absorbed MLA (D_qk = 576 = 512 latent + 64 rotary, D_v = 512),
// never dense (D != D_v), and any dim in (512, 576]. Dims in (256, 512] run
// in 512's. One row per SIMD-group at both (decode_rows_per_simd); the
// key-group merge takes 8 * (2 + 576) * 4 = 18,496 bytes at 576, 16,448 at
// 512, within 32 KiB.

// The backward's two kernels. Blocks per (dtype, bucket), as
// choose_backward (csrc/metal/routing.cpp) chooses and explains them: R
// owned rows (R / 8 row groups), S streamed rows and F feature parts of the
// accumulators, a SIMD-group each (WM = R / 8 * F), with both kernels'
// live values within the 72-value register budget, the tiles and the
// parts' split-K scratch within 32 KiB, and 8 resident SIMD-groups per core
// on every named chip (float32 at 80 and 256 recomputes instead, the scratch
// not fitting). float32 has no 72: its blocks there (16,16,3) hold 6 resident
// SIMD-groups, so head dims 65-72 run zero-padded in 80's (choose_backward).
#define FM_BACKWARD(tname, T, D, R, S, F, WM)                                                        \
  FM_INSTANTIATE("flash_backward_dq_" #tname "_d" #D "_bq" #R "_bk" #S "_wm" #WM "_ds" #F,          \
                 flash_backward_dq<T, D, R, S, WM, F>)                                              \
  FM_INSTANTIATE("flash_backward_dkdv_" #tname "_d" #D "_bq" #S "_bk" #R "_wm" #WM "_ds" #F,        \
                 flash_backward_dkdv<T, D, S, R, WM, F>)

// The split-D backward at head dim 512 (attention_backward_splitd.h, issue
// 20 section 3): dQ over 8 query rows x 32-key blocks, dK/dV over 8 keys x
// 32-row query blocks, each on 8 SIMD-groups of 64 features (the header says
// why these; csrc/metal/families/prefill_splitd.cpp plans them). One pair per dtype.
#define FM_BACKWARD_SPLITD(tname, T)                                                  \
  FM_INSTANTIATE("flash_backward_splitd_dq_" #tname "_d512_bq8_bk32_wm8",              \
                 flash_backward_splitd_dq<T, 512, 8, 32, 8>)                          \
  FM_INSTANTIATE("flash_backward_splitd_dkdv_" #tname "_d512_bq32_bk8_wm8",            \
                 flash_backward_splitd_dkdv<T, 512, 32, 8, 8>)

#define FM_BACKWARD_HALF_ALL_D(tname, T)   \
  FM_BACKWARD(tname, T, 32, 64, 32, 1, 8)  \
  FM_BACKWARD(tname, T, 64, 64, 32, 1, 8)  \
  FM_BACKWARD(tname, T, 72, 64, 32, 1, 8)  \
  FM_BACKWARD(tname, T, 80, 64, 32, 1, 8)  \
  FM_BACKWARD(tname, T, 96, 64, 16, 1, 8)  \
  FM_BACKWARD(tname, T, 128, 32, 16, 2, 8) \
  FM_BACKWARD(tname, T, 192, 16, 16, 4, 8) \
  FM_BACKWARD(tname, T, 256, 16, 8, 4, 8)

#define FM_BACKWARD_FLOAT_ALL_D(tname, T)  \
  FM_BACKWARD(tname, T, 32, 64, 32, 1, 8)  \
  FM_BACKWARD(tname, T, 64, 32, 16, 2, 8)  \
  FM_BACKWARD(tname, T, 80, 32, 16, 2, 8)  \
  FM_BACKWARD(tname, T, 96, 16, 16, 4, 8)  \
  FM_BACKWARD(tname, T, 128, 16, 8, 4, 8)  \
  FM_BACKWARD(tname, T, 192, 8, 8, 8, 8)   \
  FM_BACKWARD(tname, T, 256, 8, 8, 8, 8)

// An explicit instantiation with an unqualified name must sit in the
// template's own namespace (C++ [temp.explicit]), hence the namespace block.
namespace flash_metal {
FM_POST_KERNELS_ALL_D(float32, float)
FM_POST_KERNELS_ALL_D(float16, half)
FM_POST_KERNELS_ALL_D(bfloat16, bfloat)
FM_PREFILL_FLOAT_ALL_D(float32, float)
FM_PREFILL_HALF_ALL_D(float16, half)
FM_PREFILL_HALF_ALL_D(bfloat16, bfloat)
FM_PREFILL_SPLITD(float32, float)
FM_PREFILL_SPLITD(float16, half)
FM_PREFILL_SPLITD(bfloat16, bfloat)
FM_DECODE_ALL_D(float32, float)
FM_DECODE_ALL_D(float16, half)
FM_DECODE_ALL_D(bfloat16, bfloat)
FM_DECODE_QUANT_ALL_D(float32, float)
FM_DECODE_QUANT_ALL_D(float16, half)
FM_DECODE_QUANT_ALL_D(bfloat16, bfloat)
FM_BACKWARD_FLOAT_ALL_D(float32, float)
FM_BACKWARD_HALF_ALL_D(float16, half)
FM_BACKWARD_HALF_ALL_D(bfloat16, bfloat)
FM_BACKWARD_SPLITD(float32, float)
FM_BACKWARD_SPLITD(float16, half)
FM_BACKWARD_SPLITD(bfloat16, bfloat)
FM_INSTANTIATE("flash_sinks_grad", flash_sinks_grad<32>)
}  // namespace flash_metal
