// The CPU kernel reading a quantized (or, impl='direct', a native) KV cache
// in place: attention_kvcache's decode and chunked prefill (issue 44;
// kvcache_quant_cpu.cpp).
#pragma once

#include "../kvcache.h"
#include "../kvcache_quant.h"

#include <vector>

namespace flash_metal {
namespace cpu {

// Writes o.out4 and o.lse3 for a validated, non-empty call whose caches kq
// describes (each side's last dim contiguous).
void kvcache_quant_forward(const KvCacheCall& kc, const KvQuant& kq, const AttentionOutputs& o);

// Calls so far: [0, 6) per K storage format (float32, float16, bfloat16,
// int8, q4, fp8_e4m3), [6, 12) the same per V format, [12] calls that split
// the keys, [13] work units run.
std::vector<int64_t> kvcache_quant_counts();

}  // namespace cpu
}  // namespace flash_metal
