// Instantiations of the FlashAttention-2 forward ("prefill") kernel; the
// template lives in attention_prefill.h. Host names encode every template
// parameter and must match the names csrc/metal_plan.cpp builds:
//   flash_attention_prefill_<dtype>_d<DMAX>_bq<BQ>_bk<BK>_wm<WM>
#include "attention_prefill.h"

// The one instantiation macro: a host name plus the template it names; the
// kernel's signature comes from decltype, so it is never repeated here.
#define FM_PREFILL_INSTANTIATE(name, ...) \
  template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;

#define FM_PREFILL(tname, T, D, BQ, BK, WM)                                                  \
  FM_PREFILL_INSTANTIATE("flash_attention_prefill_" #tname "_d" #D "_bq" #BQ "_bk" #BK "_wm" #WM, \
                         flash_attention_prefill<T, D, BQ, BK, WM>)

// Block sizes per bucket (MLX's and PyTorch's prefill table, see
// /work/shared/notes/fast-kernels.md): 4 SIMD-groups of 8 rows and 32 keys
// per block up to D = 96; 16 keys at D = 128 so that the float32 tiles stay
// within 32 KiB (25,344 bytes); at D = 256 two SIMD-groups and 8 keys
// (24,960 bytes in float32), since O alone is 64 floats per lane there.
#define FM_PREFILL_ALL_D(tname, T)  \
  FM_PREFILL(tname, T, 32, 32, 32, 4) \
  FM_PREFILL(tname, T, 64, 32, 32, 4) \
  FM_PREFILL(tname, T, 72, 32, 32, 4) \
  FM_PREFILL(tname, T, 80, 32, 32, 4) \
  FM_PREFILL(tname, T, 96, 32, 32, 4) \
  FM_PREFILL(tname, T, 128, 32, 16, 4) \
  FM_PREFILL(tname, T, 256, 16, 8, 2)

// An explicit instantiation with an unqualified name must sit in the
// template's own namespace (C++ [temp.explicit]), hence the namespace block.
namespace flash_metal {
FM_PREFILL_ALL_D(float32, float)
FM_PREFILL_ALL_D(float16, half)
FM_PREFILL_ALL_D(bfloat16, bfloat)
}  // namespace flash_metal
