// Test-only kernels (never shipped) for tests/metal/test_metal_dense_loader.py's
// check that the prefill kernel's Q.K^T feature loop is unrolled in the
// optimised IR (issue 19): one shipped instantiation, compiled alone.
#include "../shaders/prefill/attention_prefill.h"

namespace flash_metal {

#define FM_IR_INSTANTIATE(name, ...) template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;
// DMAX 32: TD = 4 feature fragments, TK = 4 key fragments (the smallest shipped tile: the quickest to compile).
FM_IR_INSTANTIATE("prefill_half_d32_bq32_bk32_wm4", flash_attention_prefill<half, 32, 32, 32, 4>)

}  // namespace flash_metal
