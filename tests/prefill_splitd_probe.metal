// Test-only kernels (never shipped) for benchmarks/metal_model_splitd.py: a
// split-D FlashAttention-2 forward for head dim 512 (issue 20, section 3),
// written as a probe so the performance model can price it from exact
// emulator counts before anything routes to it.
//
// Why a new shape of kernel. The FA2 template (shaders/attention_prefill.h)
// keeps the whole 512-wide Q block and a 512-wide K/V tile in threadgroup
// memory: 1,040 bytes per float16 row, so 32 KiB holds 8 query rows and 8
// keys, and every 8 x 8 block pays a DRAM latency and four barriers
// (tests/prefill_d512_probe.metal, benchmarks/metal_model_d512.py). Here D is
// blocked instead (metal-flash-attention blocks its head dimension too, and
// keeps operands in registers or device memory rather than threadgroup
// memory when they do not fit; the code here is this project's own):
//
//   - A threadgroup owns ROWG groups of 8 query rows and runs PARTS
//     SIMD-groups per row group; part p owns features [p * F, (p + 1) * F),
//     F = DMAX / PARTS (64 at 8 parts), of Q and of O.
//   - Q: the part's 8 x F slice in registers, read from device memory once
//     per threadgroup (F / 8 fragments, 2 floats per lane each: 16 values).
//   - O: the part's 8 x F slice in registers (16 values), as the template's
//     feature parts keep it.
//   - K and V: each part reads its own F features of each key block straight
//     from device memory into fragments. With one row group no K/V element
//     is read by two SIMD-groups, so staging through threadgroup memory
//     would buy no reuse, only two barriers and a write and a read of every
//     byte; the key block can then be 32 keys instead of 8 (no tile limits
//     it). metal-flash-attention likewise reads K/V from device memory with
//     simdgroup loads on M3 and later. The cost: K/V are read once per 8
//     (ROWG = 1) query rows, which the model prices (on-GPU link bytes).
//   - S = Q.K^T: each part multiplies over its F features (split-K), and the
//     parts sum their partial S through threadgroup memory, in part order
//     (so every part gets the same S, bit for bit, and runs the same
//     softmax). The scratch is double-buffered by block parity, so a key
//     block needs one barrier (partials written -> read): a part writing
//     block kb + 1's partials into the other buffer cannot race a read of
//     block kb - 1's, which every part finished before block kb's barrier.
//   - P.V: each part multiplies P (8 x BK, the whole block) by V's 8-key
//     fragments of its own features into its O slice.
//
// Tile choices (bytes for float16; the model in metal_model_splitd.py):
//   BK = 32: S is BK / 8 = 4 fragments (8 values per lane); 32 keys give
//     each block 256 MMAs per part-row pair to cover the block's two DRAM
//     latencies; 64 would put S at 16 values and the scratch at 32 KiB.
//   PARTS = 8: F = 64, so Q and O take 16 values each; live values
//     2 * DMAX / 4 / PARTS + BK / 4 + 22 = 62 at BK 32 (the planner's 72
//     budget, csrc/metal_routing.cpp). 4 parts would need 32 + 32.
//   Threadgroup memory: 2 buffers x WM SIMD-groups x BK / 8 fragments x
//     256 bytes = 16 KiB at WM 8, BK 32: two threadgroups per core where a
//     core has 32 KiB (M3 and later), so one hides the other's latencies.
//   ROWG = 2 (bq16, 16 SIMD-groups, 512 threads) halves the K/V traffic per
//     query row at the price of twice the scratch per block; priced too.
//
// Options: plain and causal (bottom-right) attention only, ragged Nq and Nk;
// no masks, windows, softcap, varlen or paging (a probe of the speed).
#include "../shaders/attention_prefill.h"
#include "../shaders/attention_decode.h"    // its function constants, so a plan's full list binds
#include "../shaders/attention_backward.h"  // likewise (fc_has_grad_lse)

namespace flash_metal {

// The most threads a split-D threadgroup runs: 2 row groups x 8 parts.
// Why 512: 16 SIMD-groups at 62 live values take 127 KB of a core's ~208 KB
// register file (csrc/metal_gpus.cpp), so a pipeline admits them.
constant constexpr int kSplitDMaxThreads = 512;

// Fragment (row0.., col0..) of a row-major (rows, features) matrix in device
// memory, converted to float; rows >= valid are zeros and are not read. The
// lane's two elements are adjacent features of one row.
template <typename T>
FM_INLINE void splitd_frag(thread PrefillFrag& f, device const T* base, int64_t row_stride, int64_t dim_stride,
                           int row0, int col0, int valid, int fr, int fc) {
  const int r = row0 + fr;
  float a = 0.0f, b = 0.0f;
  if (r < valid) {
    device const T* s = base + int64_t(r) * row_stride + int64_t(col0 + fc) * dim_stride;
    a = float(s[0]);
    b = float(s[dim_stride]);
  }
  f.thread_elements()[0] = a;
  f.thread_elements()[1] = b;
}

// The transpose: element (r, c) is row key0 + c, feature col0 + r, of a
// row-major (keys, features) matrix (K^T for S = Q.K^T). The lane's two
// elements are one feature of two adjacent keys; keys >= valid are zeros.
template <typename T>
FM_INLINE void splitd_frag_t(thread PrefillFrag& f, device const T* base, int64_t row_stride, int64_t dim_stride,
                             int key0, int col0, int valid, int fr, int fc) {
  device const T* s = base + int64_t(key0 + fc) * row_stride + int64_t(col0 + fr) * dim_stride;
  f.thread_elements()[0] = key0 + fc < valid ? float(s[0]) : 0.0f;
  f.thread_elements()[1] = key0 + fc + 1 < valid ? float(s[row_stride]) : 0.0f;
}

// T: q, k, v, o's type. DMAX: the head dim (q, k and v alike). ROWG: 8-row
// groups per threadgroup (BQ = 8 * ROWG). BK: keys per block. PARTS:
// SIMD-groups per row group, each owning DMAX / PARTS features.
// Launch: grid (ceil(Nq / BQ), Hq, B), threadgroup (32 * ROWG * PARTS),
// threadgroup memory 2 * ROWG * PARTS * (BK / 8) * 256 bytes at index 0,
// fc_causal (0); AttentionParams at buffer 5 with head_dim = head_dim_v = DMAX.
template <typename T, int DMAX, int ROWG, int BK, int PARTS>
[[kernel]] [[max_total_threads_per_threadgroup(kSplitDMaxThreads)]] void flash_attention_splitd(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device T* o [[buffer(3)]],
    device float* lse [[buffer(4)]],
    constant AttentionParams& p [[buffer(5)]],
    device const int* cu_seqlens_q [[buffer(15)]],
    device const int* cu_seqlens_k [[buffer(16)]],
    threadgroup float* partials [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int WM = ROWG * PARTS;
  static_assert(32 * WM <= kSplitDMaxThreads, "the declared threadgroup limit");
  static_assert(BK % 8 == 0 && DMAX % (8 * PARTS) == 0, "blocks and parts are whole 8x8 fragments");
  constexpr int TK = BK / 8;             // key fragments of S per block
  constexpr int TF = DMAX / 8 / PARTS;   // feature fragments of Q and O this SIMD-group keeps
  constexpr int SLOT = TK * 64;          // floats of one SIMD-group's partial S
  const int rg = int(sg) % ROWG;
  const int part = int(sg) / ROWG;
  const int col0 = part * (DMAX / PARTS);  // this part's first feature

  const SeqView seq = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const HeadOffsets h = head_offsets(p, group.z, group.y);
  const int q0 = int(group.x) * 8 * ROWG;
  const int sg_row0 = q0 + rg * 8;
  const int fr = prefill_frag_row(lane);
  const int fc = prefill_frag_col(lane);
  const int row = sg_row0 + fr;

  // Q: this part's 8 x F slice, once, unscaled (scaled in float after the
  // product, as the template does).
  PrefillFrag Q[TF];
  FM_UNROLL for (int i = 0; i < TF; ++i) {
    splitd_frag(Q[i], q + h.q, p.q_row_stride, p.q_dim_stride, sg_row0, col0 + i * 8, seq.q_len, fr, fc);
  }
  PrefillFrag O[TF];
  FM_UNROLL for (int i = 0; i < TF; ++i) O[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  OnlineSoftmax sm;
  float l_run = 0.0f;  // the template's two-level row sum (kPrefillSumRun)

  // Key blocks up to what the threadgroup's last real row sees (causal
  // blocks in the future of every row are never read). Uniform.
  const int last_row = min(q0 + 8 * ROWG, seq.q_len) - 1;
  const int n_blocks = (visible_key_end(seq, last_row) + BK - 1) / BK;
  for (int kb = 0; kb < n_blocks; ++kb) {
    const int k0 = kb * BK;
    // Work for this SIMD-group's rows (uniform across it); it meets the
    // barrier either way.
    const bool active = sg_row0 < seq.q_len && (!fc_causal || k0 <= sg_row0 + 7 + seq.upper);
    const bool diagonal = fc_causal && k0 + BK - 1 > sg_row0 + seq.upper;
    const bool k_edge = k0 + BK > seq.kv_len;
    threadgroup float* scratch = partials + (kb & 1) * (WM * SLOT);  // this block's buffer

    PrefillFrag S[TK];
    if (active) {
      FM_UNROLL for (int t = 0; t < TK; ++t) S[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      FM_UNROLL for (int i = 0; i < TF; ++i) {
        FM_UNROLL for (int t = 0; t < TK; ++t) {
          PrefillFrag kf;
          splitd_frag_t(kf, k + h.k, p.k_row_stride, p.k_dim_stride, k0 + t * 8, col0 + i * 8, seq.kv_len, fr, fc);
          prefill_mma(S[t], Q[i], kf);
        }
      }
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        FM_UNROLL for (int j = 0; j < 2; ++j) scratch[int(sg) * SLOT + t * 64 + int(lane) * 2 + j] =
            S[t].thread_elements()[j];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // partials written before any part sums them (RAW)

    float alpha = 1.0f;
    if (active) {
      // The row group's S: its parts' partials summed in part order.
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        FM_UNROLL for (int j = 0; j < 2; ++j) {
          float sum = 0.0f;
          FM_UNROLL for (int pp = 0; pp < PARTS; ++pp) {
            sum += scratch[(rg + pp * ROWG) * SLOT + t * 64 + int(lane) * 2 + j];
          }
          const int key = k0 + t * 8 + fc + j;
          const bool keep = !(k_edge && key >= seq.kv_len) && !(diagonal && key > row + seq.upper);
          S[t].thread_elements()[j] = keep ? sum * p.scale_log2 : kMaskedScore;
        }
      }
      // Online softmax over the block (as attention_prefill.h).
      float block_max = sm.m;
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        block_max = max(block_max, max(S[t].thread_elements()[0], S[t].thread_elements()[1]));
      }
      block_max = max(block_max, simd_shuffle_xor(block_max, 1));
      block_max = max(block_max, simd_shuffle_xor(block_max, 8));
      alpha = exp2(sm.m - block_max);
      float block_sum = 0.0f;
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        FM_UNROLL for (int j = 0; j < 2; ++j) {
          const float s = S[t].thread_elements()[j];
          const float w = s <= kMaskedScore ? 0.0f : exp2(s - block_max);
          S[t].thread_elements()[j] = w;
          block_sum += w;
        }
      }
      block_sum += simd_shuffle_xor(block_sum, 1);
      block_sum += simd_shuffle_xor(block_sum, 8);
      sm.l *= alpha;
      l_run = l_run * alpha + block_sum;
      if (kb % kPrefillSumRun == kPrefillSumRun - 1) {
        sm.l += l_run;
        l_run = 0.0f;
      }
      sm.m = block_max;

      // O = alpha * O + P.V over this part's features, one rounding per block.
      FM_UNROLL for (int i = 0; i < TF; ++i) {
        PrefillFrag pv = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        FM_UNROLL for (int t = 0; t < TK; ++t) {
          PrefillFrag vf;
          splitd_frag(vf, v + h.v, p.v_row_stride, p.v_dim_stride, k0 + t * 8, col0 + i * 8, seq.kv_len, fr, fc);
          prefill_mma(pv, S[t], vf);
        }
        FM_UNROLL for (int j = 0; j < 2; ++j) {
          O[i].thread_elements()[j] = fma(O[i].thread_elements()[j], alpha, pv.thread_elements()[j]);
        }
      }
    }
  }
  sm.l += l_run;

  if (row < seq.q_len) {
    const float inv = sm.inv_sum();
    device T* op = o + h.o + int64_t(row) * p.o_row_stride;
    FM_UNROLL for (int i = 0; i < TF; ++i) {
      FM_UNROLL for (int j = 0; j < 2; ++j) {
        op[int64_t(col0 + i * 8 + fc + j) * p.o_dim_stride] = static_cast<T>(O[i].thread_elements()[j] * inv);
      }
    }
    if (fc == 0 && part == 0) {
      const uint bits = sm.has_key() ? as_type<uint>(fma(sm.m, M_LN2_F, log(sm.l))) : kNegInfBits;
      lse[h.lse + int64_t(row) * p.lse_row_stride] = as_type<float>(bits);
    }
  }
}

// The same plan with the softmax shared instead of repeated (the "coop"
// variant). Above, each of the PARTS SIMD-groups of a row group sums all
// PARTS partials and runs the whole block's softmax: 8 exp2 per (row, key)
// at 8 parts, and 8 reads of every partial. Here part p finishes only keys
// [4p, 4p + 4) of the block, one (row, key) per lane (row lane / 4, key
// lane % 4): it sums their partials, takes the row's max over its 4 keys
// (2 shuffles) and publishes it; after a barrier every lane takes the
// block's row max from the PARTS published ones (in part order: max is
// exact, so every part gets the same value), writes its weight P and its
// row sum; after a third barrier each part reads the whole P (8 x BK) and
// the PARTS row sums for its O update. 2 exp2 per (row, key) (the weight
// and each lane's alpha), 3 barriers per block. The scratch is read once
// per block, so it needs no second buffer: a write of block kb + 1's
// partials follows barrier 3 of block kb, which every reader of block kb's
// passed after its reads (likewise the row maxima, P and the sums). One
// row group (ROWG = 1) and BK = 4 * PARTS (one key per lane per part).
// Threadgroup memory: PARTS x 8 x BK partials + 8 x BK weights + 2 x PARTS x 8
// row values, floats: 9.5 KiB at BK 32.
template <typename T, int DMAX, int BK, int PARTS>
[[kernel]] [[max_total_threads_per_threadgroup(kSplitDMaxThreads)]] void flash_attention_splitd_coop(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device T* o [[buffer(3)]],
    device float* lse [[buffer(4)]],
    constant AttentionParams& p [[buffer(5)]],
    device const int* cu_seqlens_q [[buffer(15)]],
    device const int* cu_seqlens_k [[buffer(16)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  static_assert(32 * PARTS <= kSplitDMaxThreads, "the declared threadgroup limit");
  static_assert(BK == 4 * PARTS, "each part finishes 4 keys of the block, one (row, key) per lane");
  static_assert(DMAX % (8 * PARTS) == 0, "parts are whole 8x8 fragments");
  constexpr int TK = BK / 8;
  constexpr int TF = DMAX / 8 / PARTS;
  constexpr int SLOT = 8 * BK;  // floats of one part's partial S, row-major (row * BK + key)
  threadgroup float* scratch = smem;                       // PARTS x 8 x BK
  threadgroup float* weights = scratch + PARTS * SLOT;     // 8 x BK: the block's P
  threadgroup float* row_max = weights + SLOT;             // PARTS x 8
  threadgroup float* row_sum = row_max + PARTS * 8;        // PARTS x 8
  const int part = int(sg);
  const int col0 = part * (DMAX / PARTS);

  const SeqView seq = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const HeadOffsets h = head_offsets(p, group.z, group.y);
  const int q0 = int(group.x) * 8;
  const int fr = prefill_frag_row(lane);
  const int fc = prefill_frag_col(lane);
  const int row = q0 + fr;             // this lane's row in the fragments (O, P.V)
  const int b_row = int(lane) / 4;     // and in the shared softmax step
  const int b_col = part * 4 + int(lane) % 4;  // its key there, within the block

  PrefillFrag Q[TF];
  FM_UNROLL for (int i = 0; i < TF; ++i) {
    splitd_frag(Q[i], q + h.q, p.q_row_stride, p.q_dim_stride, q0, col0 + i * 8, seq.q_len, fr, fc);
  }
  PrefillFrag O[TF];
  FM_UNROLL for (int i = 0; i < TF; ++i) O[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  float m_frag = kMaskedScore;  // running max of row `row` (the O rescale)
  float m_b = kMaskedScore;     // running max of row q0 + b_row (the weights); the same values per row
  float l = 0.0f, l_run = 0.0f;

  const int last_row = min(q0 + 8, seq.q_len) - 1;
  const int n_blocks = (visible_key_end(seq, last_row) + BK - 1) / BK;  // uniform: one row group
  for (int kb = 0; kb < n_blocks; ++kb) {
    const int k0 = kb * BK;
    PrefillFrag S[TK];
    FM_UNROLL for (int t = 0; t < TK; ++t) S[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    FM_UNROLL for (int i = 0; i < TF; ++i) {
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        PrefillFrag kf;
        splitd_frag_t(kf, k + h.k, p.k_row_stride, p.k_dim_stride, k0 + t * 8, col0 + i * 8, seq.kv_len, fr, fc);
        prefill_mma(S[t], Q[i], kf);
      }
    }
    FM_UNROLL for (int t = 0; t < TK; ++t) {
      FM_UNROLL for (int j = 0; j < 2; ++j) scratch[part * SLOT + fr * BK + t * 8 + fc + j] = S[t].thread_elements()[j];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // partials written before they are summed (RAW)

    // This lane's (row, key): its S summed in part order, scaled, masked.
    float s = 0.0f;
    FM_UNROLL for (int pp = 0; pp < PARTS; ++pp) s += scratch[pp * SLOT + b_row * BK + b_col];
    const int b_key = k0 + b_col;
    const bool keep = b_key < seq.kv_len && (!fc_causal || b_key <= q0 + b_row + seq.upper);
    s = keep ? s * p.scale_log2 : kMaskedScore;
    float mx = max(s, simd_shuffle_xor(s, 1));  // the 4 lanes 4r..4r+3 hold row r's keys of this part
    mx = max(mx, simd_shuffle_xor(mx, 2));
    if (int(lane) % 4 == 0) row_max[part * 8 + b_row] = mx;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // row maxima written before they are read (RAW)

    float blk_b = m_b;
    FM_UNROLL for (int pp = 0; pp < PARTS; ++pp) blk_b = max(blk_b, row_max[pp * 8 + b_row]);
    const float w = s <= kMaskedScore ? 0.0f : exp2(s - blk_b);
    m_b = blk_b;
    weights[b_row * BK + b_col] = w;
    float ws = w + simd_shuffle_xor(w, 1);
    ws += simd_shuffle_xor(ws, 2);
    if (int(lane) % 4 == 0) row_sum[part * 8 + b_row] = ws;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // P and row sums written before they are read (RAW)

    // The O update: the row's block max and sum from every part's (in part
    // order, so every part has the same l), P from the shared block.
    float blk = m_frag;
    FM_UNROLL for (int pp = 0; pp < PARTS; ++pp) blk = max(blk, row_max[pp * 8 + fr]);
    const float alpha = exp2(m_frag - blk);
    float block_sum = 0.0f;
    FM_UNROLL for (int pp = 0; pp < PARTS; ++pp) block_sum += row_sum[pp * 8 + fr];
    l *= alpha;
    l_run = l_run * alpha + block_sum;
    if (kb % kPrefillSumRun == kPrefillSumRun - 1) {
      l += l_run;
      l_run = 0.0f;
    }
    m_frag = blk;
    FM_UNROLL for (int t = 0; t < TK; ++t) prefill_read_frag(S[t], weights, BK, 0, t * 8, fr, fc);
    FM_UNROLL for (int i = 0; i < TF; ++i) {
      PrefillFrag pv = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        PrefillFrag vf;
        splitd_frag(vf, v + h.v, p.v_row_stride, p.v_dim_stride, k0 + t * 8, col0 + i * 8, seq.kv_len, fr, fc);
        prefill_mma(pv, S[t], vf);
      }
      FM_UNROLL for (int j = 0; j < 2; ++j) {
        O[i].thread_elements()[j] = fma(O[i].thread_elements()[j], alpha, pv.thread_elements()[j]);
      }
    }
  }
  l += l_run;

  if (row < seq.q_len) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    device T* op = o + h.o + int64_t(row) * p.o_row_stride;
    FM_UNROLL for (int i = 0; i < TF; ++i) {
      FM_UNROLL for (int j = 0; j < 2; ++j) {
        op[int64_t(col0 + i * 8 + fc + j) * p.o_dim_stride] = static_cast<T>(O[i].thread_elements()[j] * inv);
      }
    }
    if (fc == 0 && part == 0) {
      const uint bits = l > 0.0f ? as_type<uint>(fma(m_frag, M_LN2_F, log(l))) : kNegInfBits;
      lse[h.lse + int64_t(row) * p.lse_row_stride] = as_type<float>(bits);
    }
  }
}

#define FM_SPLITD(name, ...) template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;
// The plan: 8 rows, 32 keys, 8 parts of 64 features (16 KiB of scratch).
FM_SPLITD("flash_attention_splitd_float16_d512_bq8_bk32_wm8", flash_attention_splitd<half, 512, 1, 32, 8>)
// Shorter blocks: 8 KiB of scratch, more blocks to cover the latencies.
FM_SPLITD("flash_attention_splitd_float16_d512_bq8_bk16_wm8", flash_attention_splitd<half, 512, 1, 16, 8>)
// Two row groups on 16 SIMD-groups: K/V read once per 16 query rows.
FM_SPLITD("flash_attention_splitd_float16_d512_bq16_bk32_wm16", flash_attention_splitd<half, 512, 2, 32, 8>)
// The shared softmax (the coop variant above), the plan's blocks.
FM_SPLITD("flash_attention_splitd_coop_float16_d512_bq8_bk32_wm8", flash_attention_splitd_coop<half, 512, 32, 8>)
// bfloat16, for correctness only.
FM_SPLITD("flash_attention_splitd_bfloat16_d512_bq8_bk32_wm8", flash_attention_splitd<bfloat, 512, 1, 32, 8>)

}  // namespace flash_metal
