// attention_kvcache: validation and the gather path (see kvcache.h).
#include "kvcache.h"

#include <c10/util/Exception.h>

#include <limits>

namespace flash_metal {
namespace {

constexpr const char* kOp = kKvCacheOpName;
// Why 2^31: the decode kernels count keys, table entries and rows in int32
// (attention_decode_paged.h); page offsets are 64-bit.
constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();

void check_cache(const at::Tensor& t, const char* name, const at::Tensor& q, bool paged, bool quantized) {
  TORCH_CHECK_VALUE(t.defined(), kOp, ": ", name, " is undefined (None)");
  TORCH_CHECK_TYPE(quantized || t.scalar_type() == q.scalar_type(), kOp, ": ", name, " has dtype ", t.scalar_type(),
                   " but q has dtype ", q.scalar_type(), "; q and the caches must share one dtype");
  TORCH_CHECK_VALUE(t.device() == q.device(), kOp, ": ", name, " is on device ", t.device(), " but q is on device ",
                    q.device());
  TORCH_CHECK_VALUE(t.dim() == 4, kOp, ": ", name, " must be 4-D ",
                    paged ? "(num_blocks, page_size, kv_heads, head_dim)" : "(batch, seqlen, kv_heads, head_dim)",
                    "; got shape ", t.sizes());
  for (int64_t d = 0; d < 4; ++d) {
    TORCH_CHECK_VALUE(t.size(d) <= kMaxInt32, kOp, ": ", name, " dimension ", d, " has size ", t.size(d),
                      "; sizes must be below 2^31");
  }
}

void check_int32(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, kOp, ": ", name, " must be int32 (as in flash-attn); got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == q.device(), kOp, ": ", name, " is on device ", t.device(), " but q is on device ",
                    q.device());
}

// On CPU: every length within the capacity, every entry in use a block of the cache.
void check_values(const KvCacheCall& kc, int64_t num_blocks, bool plain) {
  const AttentionProblem& p = kc.c.p;
  const int32_t* len = kc.cache_seqlens.const_data_ptr<int32_t>();
  const int32_t* table = kc.block_table.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < p.batch; ++b) {
    TORCH_CHECK_VALUE(len[b] >= 0 && len[b] <= p.kv_len, kOp, ": cache_seqlens[", b, "] = ", len[b],
                      " is outside [0, ", p.kv_len, "]: ",
                      plain ? "the cache's seqlen" : "the block table's capacity (max_blocks_per_seq * page_size)");
    const int64_t used = (int64_t{len[b]} + p.page_size - 1) / p.page_size;
    for (int64_t e = 0; e < used; ++e) {
      const int32_t id = table[b * p.table_stride + e];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, kOp, ": block_table[", b, ", ", e, "] = ", id,
                        " is out of range: entries in use must name one of k_cache's ", num_blocks, " blocks, 0 .. ",
                        num_blocks - 1);
    }
  }
}

// Packed queries: cu_seqlens_q int32 (B + 1,) on q's device, max_seqlen_q in [0, 2^31).
void check_packed_queries(const at::Tensor& cu, int64_t max_seqlen_q, const at::Tensor& q) {
  TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt, kOp, ": cu_seqlens_q must be int32 (as in flash-attn); got ",
                   cu.scalar_type());
  TORCH_CHECK_VALUE(cu.device() == q.device(), kOp, ": cu_seqlens_q is on device ", cu.device(),
                    " but q is on device ", q.device());
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.size(0) >= 1, kOp, ": cu_seqlens_q must be 1-D of shape (batch + 1,) "
                    "holding each sequence's first query row and the total; got shape ", cu.sizes());
  TORCH_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_q <= kMaxInt32, kOp,
                    ": max_seqlen_q must be in [0, 2^31); got ", max_seqlen_q);
}

// On CPU: cu_seqlens_q starts at 0, never decreases, ends at total_q, and no
// sequence is longer than max_seqlen_q.
void check_query_offsets(const at::Tensor& cu, int64_t total_q, int64_t max_seqlen_q) {
  const int32_t* d = cu.const_data_ptr<int32_t>();
  const int64_t n = cu.size(0);
  TORCH_CHECK_VALUE(d[0] == 0, kOp, ": cu_seqlens_q[0] must be 0; got ", d[0]);
  for (int64_t b = 0; b + 1 < n; ++b) {
    const int64_t len = int64_t{d[b + 1]} - d[b];
    TORCH_CHECK_VALUE(len >= 0, kOp, ": cu_seqlens_q must be non-decreasing; cu_seqlens_q[", b + 1, "] = ",
                      d[b + 1], " < cu_seqlens_q[", b, "] = ", d[b]);
    TORCH_CHECK_VALUE(len <= max_seqlen_q, kOp, ": sequence ", b, " has ", len, " queries (from cu_seqlens_q) but "
                      "max_seqlen_q is ", max_seqlen_q, "; it must be at least every sequence's length");
  }
  TORCH_CHECK_VALUE(d[n - 1] == total_q, kOp, ": cu_seqlens_q[-1] must equal q's number of packed rows (", total_q,
                    "); got ", d[n - 1]);
}

}  // namespace

KvCacheCall check_kvcache_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
                                 const AttentionOptions& options, const std::optional<at::Tensor>& cu_seqlens_q,
                                 int64_t max_seqlen_q, const KvQuant* quant) {
  TORCH_CHECK_VALUE(q.defined(), kOp, ": q is undefined (None)");
  const bool varlen = cu_seqlens_q.has_value() && cu_seqlens_q->defined();
  check_tensor(kOp, q, "q", q, varlen ? 3 : 4);
  if (varlen) check_packed_queries(*cu_seqlens_q, max_seqlen_q, q);
  const bool paged = block_table.has_value() && block_table->defined();
  const bool qk = quant != nullptr && quant->k.format != KvFormat::Native;
  const bool qv = quant != nullptr && quant->v.format != KvFormat::Native;
  check_cache(k_cache, "k_cache", q, paged, qk);
  check_cache(v_cache, "v_cache", q, paged, qv);
  // The logical head dims (a 4-bit cache packs 8 or 2 codes per element).
  const int64_t k_dim = qk ? quant->k.head_dim : k_cache.size(3);
  const int64_t v_dim = qv ? quant->v.head_dim : v_cache.size(3);
  TORCH_CHECK_VALUE(!(options.attn_mask.has_value() && options.attn_mask->defined()), kOp,
                    ": attn_mask is not supported with a KV cache (as in flash-attn)");
  // Packed queries (total_q, Hq, D) are seen as the kernels' (1, Hq, total_q, D) view.
  const at::Tensor q4 = varlen ? q.unsqueeze(0).transpose(1, 2) : q;
  const int64_t B = varlen ? cu_seqlens_q->size(0) - 1 : q.size(0), D = q4.size(3);
  const int64_t num_blocks = k_cache.size(0), page = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK_VALUE(v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3), kOp,
                    ": v_cache must have k_cache's ",
                    paged ? "(num_blocks, page_size, kv_heads) " : "(batch, seqlen, kv_heads) ",
                    k_cache.sizes().slice(0, 3), " (its head_dim D_v may differ); got shape ", v_cache.sizes());
  TORCH_CHECK_VALUE(k_dim == D, kOp, ": k_cache has head_dim ", k_dim, " but q has head_dim ", D,
                    "; they must match");
  TORCH_CHECK_VALUE(kv_heads >= 1 && q4.size(1) % kv_heads == 0, kOp, ": the number of query heads (", q4.size(1),
                    ") must be a multiple of k_cache's kv_heads (", kv_heads, ", dimension 2)");
  TORCH_CHECK_VALUE(page >= 1, kOp, ": k_cache's ", paged ? "page_size" : "seqlen",
                    " (dimension 1) must be at least 1; got 0");
  check_int32(cache_seqlens, "cache_seqlens", q);
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B, kOp,
                    ": cache_seqlens must have shape (batch,) = (", B, ",), one key count per sequence; got shape ",
                    cache_seqlens.sizes());

  KvCacheCall kc;
  kc.options = options;
  kc.k_cache = k_cache;
  kc.v_cache = v_cache;
  kc.cache_seqlens = cache_seqlens.contiguous();
  if (paged) {
    const at::Tensor& t = *block_table;
    check_int32(t, "block_table", q);
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == B, kOp, ": block_table must have shape (batch, max_blocks_per_seq) "
                      "with batch = ", B, "; got shape ", t.sizes());
    // Entries of a row contiguous (the kernel steps them by 1); rows at any stride >= 1.
    kc.block_table = t.size(1) <= 1 || t.stride(1) == 1 ? t : t.contiguous();
  } else {
    // A plain cache: sequence b is row b, one page of seqlen keys.
    TORCH_CHECK_VALUE(num_blocks >= B, kOp, ": k_cache holds ", num_blocks, " sequences but q has batch ", B,
                      "; give a block_table to pick the cache rows");
    kc.block_table = at::arange(B, q.options().dtype(at::kInt)).view({B, 1});
  }
  const int64_t max_blocks = kc.block_table.size(1);
  const int64_t capacity = max_blocks * page;
  TORCH_CHECK_VALUE(capacity <= kMaxInt32, kOp, ": the block table's capacity (max_blocks_per_seq * page_size = ",
                    capacity, " keys) must be below 2^31");

  AttentionProblem& p = kc.c.p;
  p.batch = B;
  p.q_heads = q4.size(1);
  p.q_len = varlen ? max_seqlen_q : q4.size(2);
  p.head_dim = D;
  p.head_dim_v = v_dim;
  p.kv_heads = kv_heads;
  p.kv_len = capacity;
  p.dtype = q.scalar_type();
  p.total_q = q4.size(2);  // varlen: the packed rows; otherwise Nq
  p.total_k = p.kv_len;
  // Packed queries (flash_attn_varlen_func with block_table): sequence b's
  // queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q; its
  // keys, as without them, come through table row b, cache_seqlens[b] of them.
  p.varlen = varlen;
  TORCH_CHECK_VALUE(p.head_dim <= kMaxHeadDim && p.head_dim_v <= kMaxHeadDimV, kOp,
                    ": head dims must be at most ", kMaxHeadDim, " (q, k_cache) and ", kMaxHeadDimV,
                    " (v_cache); got ", p.head_dim, " and ", p.head_dim_v);
  apply_scalar_options(kOp, options, &p);
  p.paged = true;
  if (quant != nullptr) {
    kc.quant = *quant;
    describe_kv_quant(*quant, &p);
  }
  p.page_size = page;
  p.table_stride = kc.block_table.size(0) > 1 ? kc.block_table.stride(0) : max_blocks;
  TORCH_CHECK_VALUE(p.table_stride <= kMaxInt32, kOp, ": block_table's row stride must be below 2^31");
  kc.c.q = q4;
  if (varlen) {
    kc.cu_seqlens_q = cu_seqlens_q->contiguous();
    kc.c.cu_seqlens_q = kc.cu_seqlens_q;
    // Bound but never read under fc_paged (the key counts are cache_seqlens).
    kc.c.cu_seqlens_k = kc.cu_seqlens_q;
  }
  // (num_blocks, Hkv, page, D) views: the page stride as the batch stride, the row-in-page stride as the row stride.
  kc.c.k = k_cache.transpose(1, 2);
  kc.c.v = v_cache.transpose(1, 2);
  if (options.sinks.has_value() && options.sinks->defined()) {
    kc.c.sinks = checked_sinks(kOp, *options.sinks, p, q);
    p.sinks = true;
  }
  if (q.device().is_cpu()) {
    check_values(kc, num_blocks, !paged);
    if (varlen) check_query_offsets(kc.cu_seqlens_q, p.total_q, max_seqlen_q);
  }
  return kc;
}

GatheredKvCache gather_kvcache(const KvCacheCall& kc) {
  const AttentionProblem& p = kc.c.p;
  const auto long_opts = kc.cache_seqlens.options().dtype(at::kLong);
  const at::Tensor lengths = kc.cache_seqlens.to(at::kLong);
  // Batch index and key index of every row in use, in batch order.
  const at::Tensor b_of = at::repeat_interleave(lengths);
  const at::Tensor first = at::cumsum(lengths, 0) - lengths;
  const at::Tensor j = at::arange(b_of.size(0), long_opts) - first.index_select(0, b_of);
  const at::Tensor entry = at::div(j, p.page_size, "floor");
  const at::Tensor table = kc.block_table.to(at::kLong).contiguous();  // (B, max_blocks), rows packed
  const at::Tensor block = table.flatten().index_select(0, b_of * table.size(1) + entry);
  const at::Tensor rows = block * p.page_size + (j - entry * p.page_size);
  const auto packed = [&](const at::Tensor& cache) {
    // (num_blocks * page, Hkv, D): a view when blocks and rows merge; only the rows in use are copied.
    return cache.reshape({cache.size(0) * cache.size(1), cache.size(2), cache.size(3)}).index_select(0, rows);
  };
  GatheredKvCache g;
  g.k = packed(kc.k_cache);
  g.v = packed(kc.v_cache);
  // Packed queries stay as given; equal-length ones are packed (B * Nq, Hq, D).
  g.q = p.varlen ? kc.c.q.squeeze(0).transpose(0, 1)
                 : kc.c.q.transpose(1, 2).reshape({p.batch * p.q_len, p.q_heads, p.head_dim});
  g.cu_seqlens_k = at::cat({at::zeros({1}, long_opts), at::cumsum(lengths, 0)}).to(at::kInt);
  g.cu_seqlens_q = p.varlen ? kc.cu_seqlens_q : (at::arange(p.batch + 1, long_opts) * p.q_len).to(at::kInt);
  g.max_seqlen_q = p.q_len;
  g.max_seqlen_k = p.batch > 0 ? lengths.max().item<int64_t>() : 0;
  return g;
}

std::tuple<at::Tensor, at::Tensor> unpack_gathered(const KvCacheCall& kc, const at::Tensor& out,
                                                   const at::Tensor& lse) {
  const AttentionProblem& p = kc.c.p;
  if (p.varlen) return {out, lse};  // (total_q, Hq, D_v) and (Hq, total_q), as attention_varlen returns them
  return {out.view({p.batch, p.q_len, p.q_heads, p.head_dim_v}).transpose(1, 2).contiguous(),
          lse.view({p.q_heads, p.batch, p.q_len}).permute({1, 0, 2}).contiguous()};
}

}  // namespace flash_metal
