// Test-only kernels (never shipped) for benchmarks/model/families/d512.py: the
// FlashAttention-2 prefill template instantiated at D = 512, which no
// shipped bucket has, so the model can price a fused D = 512 plan from exact
// emulator counts before anything routes to one (issue 20, section 3).
#include "../shaders/prefill/attention_prefill.h"
#include "../shaders/decode/attention_decode.h"      // its function constants, so a plan's full list binds
#include "../shaders/backward/attention_backward.h"  // likewise (fc_has_grad_lse)

namespace flash_metal {

#define FM_PROBE(name, ...) template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;
// The one legal block shape: 8 query rows, 8 keys, 8 SIMD-groups each
// holding 64 of O's 512 features (16 floats per lane), 18,688 bytes of tiles.
FM_PROBE("flash_attention_prefill_float16_d512_bq8_bk8_wm8", flash_attention_prefill<half, 512, 8, 8, 8>)
// Two row groups, 4 parts of 128 features: O alone is 32 floats per lane,
// past the register budget with S and the loads: priced as a bound only.
FM_PROBE("flash_attention_prefill_float16_d512_bq16_bk8_wm8", flash_attention_prefill<half, 512, 16, 8, 8>)

}  // namespace flash_metal
