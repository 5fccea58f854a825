// Instantiations of the attention kernels; the templates live in the .h files.
// Host names encode every template parameter, and must match the names
// csrc/metal_plan.cpp builds:
//   flash_attention_untiled_<dtype>_d<DMAX>_t<THREADS>
//   flash_attention_tiled_<dtype>_d<DMAX>_bk<BK>_t<THREADS>
#include "attention_untiled.h"
#include "attention_tiled.h"

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

// An explicit instantiation with an unqualified name must sit in the
// template's own namespace (C++ [temp.explicit]), hence the namespace block.
namespace flash_metal {
FM_POST_KERNELS_ALL_D(float32, float)
FM_POST_KERNELS_ALL_D(float16, half)
FM_POST_KERNELS_ALL_D(bfloat16, bfloat)
}  // namespace flash_metal
