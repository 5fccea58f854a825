// Instantiations of the decode (Nq <= 8) kernels; the templates and their
// launch formulas live in attention_decode.h. Host names encode every
// template parameter and must match the names csrc/metal_plan.cpp builds:
//   flash_decode_<dtype>_d<DMAX>         one pass
//   flash_decode_split_<dtype>_d<DMAX>   split-KV pass 1 (partials)
//   flash_decode_merge_<dtype>_d<DMAX>   split-KV pass 2 (merge)
#include "attention_decode.h"

// The one instantiation macro: a host name plus the template it names; the
// kernel's signature comes from decltype, so it is never repeated here.
#define FM_DECODE_INSTANTIATE(name, ...) \
  template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;

#define FM_DECODE(tname, T, D)                                                                        \
  FM_DECODE_INSTANTIATE("flash_decode_" #tname "_d" #D, flash_decode<T, D>)                           \
  FM_DECODE_INSTANTIATE("flash_decode_split_" #tname "_d" #D, flash_decode_split<T, D>)               \
  FM_DECODE_INSTANTIATE("flash_decode_merge_" #tname "_d" #D, flash_decode_merge<T, D>)

// The head-dim buckets of the prefill kernel (issue 9): any D <= 256 runs
// padded in the next one.
#define FM_DECODE_ALL_D(tname, T) \
  FM_DECODE(tname, T, 32)         \
  FM_DECODE(tname, T, 64)         \
  FM_DECODE(tname, T, 72)         \
  FM_DECODE(tname, T, 80)         \
  FM_DECODE(tname, T, 96)         \
  FM_DECODE(tname, T, 128)        \
  FM_DECODE(tname, T, 256)

// An explicit instantiation with an unqualified name must sit in the
// template's own namespace (C++ [temp.explicit]), hence the namespace block.
namespace flash_metal {
FM_DECODE_ALL_D(float32, float)
FM_DECODE_ALL_D(float16, half)
FM_DECODE_ALL_D(bfloat16, bfloat)
}  // namespace flash_metal
