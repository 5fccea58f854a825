// attention_kvcache (flash-attn's flash_attn_with_kvcache, the attention
// part): q against a KV cache addressed through a block table, each
// sequence with its own key count. Validation, and the gather path every
// backend shares (csrc/kvcache.cpp); the Metal decode and prefill kernels
// read the table themselves (fc_paged, shaders/common/attention_decode_paged.h,
// attention_prefill_paged.h) where kvcache_reads_table
// (csrc/metal/families/paged.cpp) routes them.
#pragma once

#include "attention_ops.h"
#include "checks.h"
#include "kvcache_quant.h"

#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace flash_metal {

constexpr const char* kKvCacheOpName = "flash_metal.attention_kvcache";

// A validated attention_kvcache call.
struct KvCacheCall {
  // p.paged, p.page_size, p.table_stride; kv_len = the table's capacity
  // (max_blocks * page_size). q (B, Hq, Nq, D) as given; k and v the caches
  // seen as (num_blocks, Hkv, page_size, D) views (no copy): the decode and
  // prefill kernels' binding (batch stride = the page stride).
  AttentionCall c;
  AttentionOptions options;  // as given (the gather path's varlen call takes them again)
  at::Tensor k_cache, v_cache;  // as given, (num_blocks, page_size, Hkv, D) / (..., D_v)
  at::Tensor block_table;       // int32 (B, max_blocks), entries contiguous (a copy when they were not)
  at::Tensor cache_seqlens;     // int32 (B,), contiguous
  at::Tensor cu_seqlens_q;      // packed queries: int32 (B + 1,), contiguous (undefined otherwise)
  KvQuant quant;                // a quantized cache's sides (c.p's k_format, ... say which), as validated
};

// Validates attention_kvcache's inputs: q (B, Hq, Nq, D); k_cache
// (num_blocks, page_size, Hkv, D) and v_cache (num_blocks, page_size, Hkv,
// D_v) in q's dtype and on q's device; cache_seqlens int32 (B,);
// block_table int32 (B, max_blocks), or None for a plain cache (B_cache >=
// B, seqlen, Hkv, D) whose row b is sequence b (one page of seqlen keys per
// sequence). On CPU the values are checked too (0 <= cache_seqlens[b] <=
// capacity, every table entry in use names a block of the cache); on MPS
// reading them would cost a device sync, so, as in flash-attn, they are the
// caller's contract (the kernels do not check them).
// With cu_seqlens_q (flash_attn_varlen_func's paged prefill), q is packed
// (total_q, Hq, D): sequence b's queries are its rows cu_seqlens_q[b] ..
// cu_seqlens_q[b + 1] - 1 (at most max_seqlen_q), its keys as above; then
// p.varlen, c.q the (1, Hq, total_q, D) view, and out (total_q, Hq, D_v) and
// lse (Hq, total_q) as attention_varlen's.
// quant (a quantized cache, csrc/kvcache_quant.h, already validated): a
// quantized side's dtype is its format's, and its head dim the logical one.
KvCacheCall check_kvcache_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
                                 const AttentionOptions& options,
                                 const std::optional<at::Tensor>& cu_seqlens_q = std::nullopt,
                                 int64_t max_seqlen_q = 0, const KvQuant* quant = nullptr);

// The gather path: each sequence's rows in use (keys 0 .. cache_seqlens[b]
// - 1, through the table; nothing else is read) copied into packed
// (total_k, Hkv, D) buffers, and q packed (B * Nq, Hq, D): a varlen call.
struct GatheredKvCache {
  at::Tensor q, k, v, cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
};
GatheredKvCache gather_kvcache(const KvCacheCall& kc);

// The gathered varlen call's outputs, out (B * Nq, Hq, D_v) and lse (Hq,
// B * Nq), as attention_kvcache returns them: (B, Hq, Nq, D_v) and (B, Hq,
// Nq), packed.
std::tuple<at::Tensor, at::Tensor> unpack_gathered(const KvCacheCall& kc, const at::Tensor& out,
                                                   const at::Tensor& lse);

// The gather path on a backend: gather, run the backend's forward kernel
// on the varlen call (impl "auto": on Metal the prefill kernel), unpack.
template <typename Kernel>
std::tuple<at::Tensor, at::Tensor> run_kvcache_gather(const KvCacheCall& kc, Kernel&& kernel) {
  const GatheredKvCache g = gather_kvcache(kc);
  const AttentionCall vc = check_varlen_inputs(g.q, g.k, g.v, g.cu_seqlens_q, g.cu_seqlens_k, g.max_seqlen_q,
                                               g.max_seqlen_k, kc.options, kKvCacheOpName);
  const auto [out, lse] = run_forward_op(vc, "auto", kernel);
  return unpack_gathered(kc, out, lse);
}

}  // namespace flash_metal
