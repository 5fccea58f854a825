// CPU implementation of flash_metal::attention_forward: a FlashAttention
// forward pass (Dao et al.; the post's blockwiseattention, in C++).
//
// Layout of the computation, per work item (batch b, query head h, up to
// kMaxSubBlocks blocks of kBlockQ queries; or, for short queries, the heads
// of one GQA group packed side by side):
//   1. pack each query block transposed and pre-scaled: QT[d][i] = q[i][d] * scale * log2(e)
//      (scores come out in base-2 units, so the softmax uses exp2 directly);
//   2. for each block of up to kBlockK keys (stopping at the causal frontier):
//        pack the K and V blocks (converted to float32) into micro-kernel panels, once for all
//        query blocks of the item, then for each query block:
//        ST = K_blk . QT            scores, transposed: one row per key, one column per query
//        issue 11's options (common.h): softcap and the attn_mask on every block when set,
//        then -inf past the causal/right bound or before the left window, on straddling
//        blocks only (key blocks wholly outside the window are never visited)
//        online softmax down the columns: running max m, running sum l per query,
//        P = exp2(ST - m_new) in place, alpha = exp2(m_old - m_new)
//        O = alpha * O + P^T . V_blk
//   3. out = O / l, lse = ln(2) * (m + log2(l)).
// Scores are kept transposed (keys x queries) so that every softmax reduction
// runs *down* columns: vertical max/add across rows, no horizontal shuffles,
// and K enters Q.K^T through scalar broadcasts (row tiles), V through vector
// loads (column panels): both micro-kernels are the classic 6 x 16 sgemm tile
// (6 x 64 with AVX-512).
// Decode-like items (<= 16 query columns, float32) read K and V in place.
// Varlen: each sequence is a batch entry with its own row offsets and
// lengths (common.h SeqRange); items run over (sequence, heads, query
// blocks), and those past a sequence's end return at once.
//
// Two head dims (issue 20 §2): Q.K^T runs over D_qk (q's and k's), P.V and
// the output over D_v (v's); they differ in MLA-style calls (DeepSeek-V3
// prefill 192/128, absorbed-MLA decode 576/512) and are equal otherwise, when
// every loop is the one it always was.
// Extra memory: one workspace per thread of about
// 4*kBlockQ*(D_qk + D_v) + kBlockK*(D_qk + D_v) + kBlockK*kBlockQ floats (~1 MB at D = 256,
// ~0.5 MB at D = 128), independent of N: never an N x N matrix.
#include "kernels.h"
#include "../metal/plan.h"
#include "common.h"
#include "forward_tiles.h"
#include "brgemm_cols.h"
#include "brgemm_split.h"
#include "brgemm_tiles.h"
#include "key_split.h"
#include "phase_clock.h"
#include "matrix_units.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

namespace flash_metal {
namespace cpu {
namespace {

using namespace fwd;  // tiling constants, micro-kernels and packing (forward_tiles.h)

// ---------------------------------------------------------------- driver

struct Geometry {
  int64_t batch, q_heads, kv_heads, q_len, kv_len, group;
  int64_t head_dim;    // D_qk: the Q.K^T products' width
  int64_t head_dim_v;  // D_v: the P.V products', out's (== head_dim but for MLA-style calls)
  bool causal;
  float scale_log2;       // softmax scale * log2(e), applied to q in float32
  int64_t q_stride[4], k_stride[4], v_stride[4], o_stride[4], lse_stride[3];
  const CallOptions* opt;  // window bounds, varlen sequences, mask, softcap (common.h)
  const float* sinks2 = nullptr;  // per query head: the sink logit * log2(e) (base 2); nullptr: no sinks
  PathChoice path;  // vector or brgemm (matrix_units.h), chosen once per call
};

// Query blocks per work item, at most. Every K/V block is packed once per
// item and reused by all its query blocks, so packing costs one pass over K/V
// per kMaxSubBlocks * kBlockQ queries instead of per kBlockQ (with one
// 64-query block per pack the packing took ~20% of the time at D = 128). Each query block keeps its
// own score block, so the micro-kernels' L1 working set is
// unchanged. Fewer sub-blocks are used when that is needed to keep both
// cores busy (see run_attention).
constexpr int64_t kMaxSubBlocks = 4;
// Items with at most this many query columns read float32 K/V in place.
// Why 16: the AVX2/NEON register-tile width, one AVX-512 vector; below it each packed element would be
// reused by fewer than 16 queries, which does not pay for the copy.
constexpr int64_t kSmallQueryCols = 16;

// D is D_qk, Dvp is D_v rounded up to whole vectors.
struct Workspace {
  FloatBuffer qt;  // kMaxSubBlocks x D x kBlockQ: transposed, pre-scaled query blocks
  FloatBuffer kb;  // kBlockK x (D + kKRowPad): converted K rows (pack_k_rows)
  FloatBuffer vb;  // kBlockK x Dvp: V block in column panels (pack_v)
  FloatBuffer st;  // kBlockK x kBlockQ: scores, then probabilities (transposed)
  FloatBuffer o;   // kMaxSubBlocks x kBlockQ x Dvp: unnormalised output accumulators
  float m[kMaxSubBlocks * kBlockQ], l[kMaxSubBlocks * kBlockQ], alpha[kBlockQ];
  float lr[kMaxSubBlocks * kBlockQ];  // the column form: sums of P as rounded for P.V (brgemm_cols.h)
  Workspace(int64_t D, int64_t Dvp) {
    qt.resize(kMaxSubBlocks * D * kBlockQ);
    kb.resize(kBlockK * (D + kKRowPad));
    vb.resize(kBlockK * Dvp);
    st.resize(kBlockK * kBlockQ);
    o.resize(kMaxSubBlocks * kBlockQ * Dvp);
  }
};

// One work item: nsub query blocks of bq <= kBlockQ rows of one head (rows
// i0 .. i0 + nsub*bq, clipped to Nq), or, when Nq < kBlockQ, one block that packs the nh query
// heads h0 .. h0+nh-1 side by side: column c is query row c % nq of head
// h0 + c / nq. Packing the heads of a GQA group reads each K/V block once for
// the whole group and fills the register tile (decode: 4 heads x 1 row).
// Sequence b's rows (varlen: its own offsets and lengths; an item whose rows
// start past the sequence's end has nothing to do). With ScoreOpts, the
// softcap and the mask run on each score block (off: not compiled in).
template <typename T, bool ScoreOpts>
void attention_item(const Geometry& g, const T* q, const T* k, const T* v, T* out, float* lse, int64_t b,
                    int64_t hk, int64_t h0, int64_t nh, int64_t i0, int64_t nsub, int64_t bq, Workspace& ws,
                    MxBuffers<T>* mx, const ColForm<T>& cf, const KeySplit* ks) {
  const CallOptions& opt = *g.opt;
  const SeqRange seq = opt.seq(b);
  if (i0 >= seq.nq) return;
  FM_PHASE_START;
  const int64_t D = g.head_dim;     // Q.K^T
  const int64_t Dv = g.head_dim_v;  // P.V and the output
  const int64_t Dvp = round_up(Dv, kG);
  const int64_t nvec = Dvp / kMW;
  const int64_t q_end = std::min(seq.nq, i0 + nsub * bq);
  // The column form (brgemm_cols.h) where the call built V^T for it.
  const bool cols = mx != nullptr && (cf.vt != nullptr || cf.split);
  const bool split = cols && cf.split;  // float16 as bfloat16 pairs (brgemm_split.h)
  nsub = (q_end - i0 + bq - 1) / bq;

  struct Sub {
    int64_t i0, nq, nrows, ncols, key_begin, key_end;
    float *qt, *o, *m, *l, *lr;
  } sub[kMaxSubBlocks];
  int64_t key_end_all = 0, key_begin_all = seq.nk;
  int64_t moff[kBlockQ];  // mask offsets of one sub-block's columns (ScoreOpts with a mask)
  for (int64_t s = 0; s < nsub; ++s) {
    Sub& u = sub[s];
    u.i0 = i0 + s * bq;
    u.nq = std::min(bq, q_end - u.i0);
    u.nrows = nh * u.nq;  // live columns of the score block
    u.ncols = round_up(u.nrows, kG);
    // Keys this block needs: all of them, or up to its last query's causal frontier.
    u.key_end = opt.key_end(seq, u.i0 + u.nq);
    u.key_begin = opt.key_begin(seq, u.i0);
    key_end_all = std::max(key_end_all, u.key_end);
    key_begin_all = std::min(key_begin_all, u.key_begin);
    u.qt = ws.qt.ptr + s * D * kBlockQ;
    u.o = ws.o.ptr + s * kBlockQ * Dvp;
    u.m = ws.m + s * kBlockQ;
    u.l = ws.l + s * kBlockQ;
    u.lr = ws.lr + s * kBlockQ;

    // 1. Q block, transposed and pre-scaled (brgemm path: in T, unscaled).
    const int64_t q_base = seq.bi * g.q_stride[0] + h0 * g.q_stride[1] + (seq.q0 + u.i0) * g.q_stride[2];
    if (mx != nullptr) {
      const int64_t nq = u.nq;
      const auto q_off = [&](int64_t c) { return q_base + (c / nq) * g.q_stride[1] + (c % nq) * g.q_stride[2]; };
      if (split)
        col_load_q_split(q, g.q_stride[3], q_off, u.nrows, u.ncols, D, cf.buf->Dp,
                         cf.buf->qs.data() + s * 4 * cf.buf->Dp * kBlockQ, mx->vnni, cf.buf->stage.data());
      else if (cols)
        col_load_q(q, g.q_stride[3], q_off, u.nrows, u.ncols, D, cf.buf->Dp, cf.buf->qv.data() + s * cf.buf->Dp * kBlockQ,
                   mx->vnni);
      else
        mx_load_q(q, g.q_stride[3], q_off, u.nrows, u.ncols, D, *mx, mx->qt.data() + s * mx->Dp * kBlockQ);
    }
    float row[kMaxHeadDim];
    for (int64_t c = 0; mx == nullptr && c < u.nrows; ++c) {
      const T* src = q + seq.bi * g.q_stride[0] + (h0 + c / u.nq) * g.q_stride[1] +
                     (seq.q0 + u.i0 + c % u.nq) * g.q_stride[2];
      convert_row(src, g.q_stride[3], D, row);
      for (int64_t d = 0; d < D; ++d) u.qt[d * kBlockQ + c] = row[d] * g.scale_log2;
    }
    for (int64_t d = 0; mx == nullptr && d < D; ++d)
      for (int64_t c = u.nrows; c < u.ncols; ++c) u.qt[d * kBlockQ + c] = 0.0f;
    std::fill(u.o, u.o + (cols ? Dv * kBlockQ : u.nrows * Dvp), 0.0f);  // O, or O^T in the column form
    std::fill(u.m, u.m + u.ncols, kNegInf);
    std::fill(u.l, u.l + u.ncols, 0.0f);
    std::fill(u.lr, u.lr + u.ncols, 0.0f);
    // Attention sinks: each row starts as if it had seen its head's sink, a
    // key of score sink (base 2, never softcapped or masked) and value zero:
    // m = sink, l = exp2(sink - m) = 1, O = 0. A sink of -inf is no sink.
    for (int64_t c = 0; g.sinks2 != nullptr && (ks == nullptr || ks->s == 0) && c < u.nrows; ++c) {
      u.m[c] = g.sinks2[h0 + c / u.nq];
      u.l[c] = u.lr[c] = u.m[c] == kNegInf ? 0.0f : 1.0f;
    }
  }
  FM_PHASE(kPhQ);

  const T* k_head = k + seq.bi * g.k_stride[0] + hk * g.k_stride[1] + seq.k0 * g.k_stride[2];
  const T* v_head = v + seq.bi * g.v_stride[0] + hk * g.v_stride[1] + seq.k0 * g.v_stride[2];
  // Decode-like items (a handful of query rows, float32 with contiguous
  // features): packing would not be amortised (each K/V element is used by
  // <= 16 queries and the loop is memory-bound), so read K and V in place.
  constexpr bool is_float = std::is_same<T, float>::value;
  const bool in_place = is_float && nsub == 1 && sub[0].ncols <= kSmallQueryCols && g.k_stride[3] == 1 &&
                        g.v_stride[3] == 1 && Dv % kG == 0;
  float* const st_all = cols ? cf.buf->st.ptr : ws.st.ptr;
  const int64_t block_k = cols ? cf.block_k : kBlockK;
  if (ks != nullptr) key_split_clip(*ks, block_k, &key_begin_all, &key_end_all);  // split decode (key_split.h)
  const int64_t vt_off = (seq.bi * g.kv_heads + hk) * Dv * cf.vt_ld + seq.k0;
  const T* vt_head = cols && !split ? cf.vt + vt_off : nullptr;
  const c10::BFloat16* vth_head = split ? cf.vth + vt_off : nullptr;
  const c10::BFloat16* vtl_head = split ? cf.vtl + vt_off : nullptr;
  const c10::BFloat16* kx_head = split ? cf.kx + ((seq.bi * g.kv_heads + hk) * cf.k_rows + seq.k0) * cf.kx_ld : nullptr;
  // The column form folds the scale into the softmax (sc) unless the score
  // options need the scaled block first (or a scale <= 0 would turn the max around).
  const bool fold_scale = cols && !ScoreOpts && g.scale_log2 > 0.0f;
  // Key blocks start at the first key any sub-block sees (the left window's
  // bound; 0 without one) and stop at the last (the causal/right bound).
  for (int64_t j0 = key_begin_all; j0 < key_end_all; j0 += block_k) {
    // K and V block -> packed panels, shared by all sub-blocks.
    const int64_t nk_all = std::min(block_k, key_end_all - j0);
    const float* kblk = ws.kb.ptr;
    const float* vblk = ws.vb.ptr;
    const T *k_mx = nullptr, *v_mx = nullptr;
    int64_t lda_mx = 0, ldv_mx = 0;
    if (split) {
      FM_PHASE(kPhK);  // K' was built for the call
    } else if (mx != nullptr) {
      k_mx = mx_k_operand(k_head + j0 * g.k_stride[2], g.k_stride[2], g.k_stride[3], nk_all, D, *mx, &lda_mx);
      FM_PHASE(kPhK);
      if (!cols)
        v_mx = mx_v_operand(v_head + j0 * g.v_stride[2], g.v_stride[2], g.v_stride[3], nk_all, Dv, *mx, &ldv_mx);
    } else if (in_place) {
      kblk = reinterpret_cast<const float*>(k_head) + j0 * g.k_stride[2];
      vblk = reinterpret_cast<const float*>(v_head) + j0 * g.v_stride[2];
    } else {
      pack_k_rows(k_head + j0 * g.k_stride[2], g.k_stride[2], g.k_stride[3], nk_all, D, ws.kb.ptr);
      pack_v(v_head + j0 * g.v_stride[2], g.v_stride[2], g.v_stride[3], nk_all, Dv, Dvp, ws.vb.ptr);
    }
    FM_PHASE(kPhV);

    // The column form runs each stage for every sub-block before the next
    // stage (all the Q.K products, then the softmaxes, then the P.V
    // products), each sub-block with scores and P of its own: the two
    // products are two brgemm kernels, and every switch between them costs
    // about 2,000 ticks of tile reconfiguration (issue 39, measured on the
    // AMX Xeon), so a key block pays two switches instead of two per
    // sub-block. The other forms do all of a sub-block at once (one stage).
    const int stages = cols ? 3 : 1;
    for (int stage = 0; stage < stages; ++stage)
    for (int64_t s = 0; s < nsub; ++s) {
      Sub& u = sub[s];
      // Skip a key block wholly outside u's window: in its future (causal)
      // or before its left bound.
      if (j0 >= u.key_end || j0 + nk_all <= u.key_begin) continue;
      // Rows of the packed tiles are in key order, so a prefix of the block
      // is a prefix of the packed K rows; V panels are indexed by nk_all.
      const int64_t nk = std::min(nk_all, u.key_end - j0);
      float* const st = cols ? st_all + s * kColBlockKMax * kBlockQ : st_all;
      T* const pp = cols && !split ? cf.buf->pp.data() + s * kColBlockKMax * kBlockQ : nullptr;
      c10::BFloat16* const ph = split ? cf.buf->ph.data() + s * kColBlockKMax * kBlockQ : nullptr;
      c10::BFloat16* const pl = split ? cf.buf->pl.data() + s * kColBlockKMax * kBlockQ : nullptr;
      const int64_t nkp = round_up(nk, 2);

      // 2d in the column form. With an odd nk the products take the even
      // nk - 1 keys and col_last_key adds the last: V^T's column past it is
      // the next key of the call (another sequence's under varlen, or one
      // outside the window), which may hold anything, NaN included, and
      // 0 * NaN is NaN; the row form pads a staged copy instead.
      const int64_t nke = nk - nk % 2;
      if (split && stage == 2) {  // O^T += Vh^T Ph + Vl^T Ph + Vh^T Pl, one kernel three times
        if (nke > 0) {
          tile_gemm_vnni(Dv, u.ncols, nke, cf.vt_ld, kBlockQ, kBlockQ, true, vth_head + j0, ph, u.o, mx->vnni);
          tile_gemm_vnni(Dv, u.ncols, nke, cf.vt_ld, kBlockQ, kBlockQ, true, vtl_head + j0, ph, u.o, mx->vnni);
          tile_gemm_vnni(Dv, u.ncols, nke, cf.vt_ld, kBlockQ, kBlockQ, true, vth_head + j0, pl, u.o, mx->vnni);
        }
        if (nke < nk) col_last_key(u.o, Dv, u.ncols, vth_head + j0 + nke, vtl_head + j0 + nke, cf.vt_ld, ph + nke * kBlockQ,
                                   pl + nke * kBlockQ);
        FM_PHASE(kPhPV);
        continue;
      }
      if (cols && stage == 2) {  // O^T += V^T P
        if (nke > 0)
          tile_gemm_vnni(Dv, u.ncols, nke, cf.vt_ld, kBlockQ, kBlockQ, /*add_c=*/true, vt_head + j0, pp, u.o, mx->vnni);
        if (nke < nk)
          col_last_key(u.o, Dv, u.ncols, vt_head + j0 + nke, static_cast<const T*>(nullptr), cf.vt_ld, pp + nke * kBlockQ,
                       static_cast<const T*>(nullptr));
        FM_PHASE(kPhPV);
        continue;
      }
      if (stage == 0) {
        // 2a. scores ST = K . QT
        if (split) {  // S^T = [Kh | Kl | Kh' | Kl] . [Qh ; Qh' ; Ql ; Ql]
          tile_gemm_vnni(nk, u.ncols, 4 * cf.buf->Dp, cf.kx_ld, kBlockQ, kBlockQ, /*add_c=*/false, kx_head + j0 * cf.kx_ld,
                         cf.buf->qs.data() + s * 4 * cf.buf->Dp * kBlockQ, st, mx->vnni);
          FM_PHASE(kPhQK);
          continue;
        } else if (cols) {
          tile_gemm_vnni(nk, u.ncols, cf.buf->Dp, lda_mx, kBlockQ, kBlockQ, /*add_c=*/false, k_mx,
                         cf.buf->qv.data() + s * cf.buf->Dp * kBlockQ, st, mx->vnni);
          FM_PHASE(kPhQK);
          continue;
        } else if (mx != nullptr)
          mx_scores(k_mx, lda_mx, mx->qt.data() + s * mx->Dp * kBlockQ, nk, u.ncols, D, g.scale_log2, *mx, st);
        else if (in_place)
          qk_block<true>(kblk, nk, g.k_stride[2], u.qt, kBlockQ, u.ncols, D, st, kBlockQ);
        else
          qk_block<true>(kblk, nk, D + kKRowPad, u.qt, kBlockQ, u.ncols, D, st, kBlockQ);
        FM_PHASE(kPhQK);
      }
      if (cols && !fold_scale) scale_block(st, nk, u.ncols, g.scale_log2);

      // 2b. softcap, then the attn_mask (common.h), then the window and
      // causality, only where the block crosses a bound.
      if (ScoreOpts) {
        if (opt.mask != MaskKind::None) {
          for (int64_t c = 0; c < u.nrows; ++c)
            moff[c] = seq.bi * opt.ms[0] + (h0 + c / u.nq) * opt.ms[1] + (u.i0 + c % u.nq) * opt.ms[2];
        }
        apply_score_options<T>(opt, st, kBlockQ, nk, u.ncols, u.nrows, moff, j0, nullptr);
      }
      if (opt.causal || opt.window_left) mask_window_block(opt, seq, st, kBlockQ, nk, j0, u.i0, u.nq, nh);
      FM_PHASE(kPhOpts);

      if (cols) {  // 2c in the column form: the softmax written as P's VNNI operand, O^T rescaled
        const float sc = fold_scale ? g.scale_log2 : 1.0f;
        bool rescale;
        if (split) {
          poison_if_emulated(ph, nkp * kBlockQ, mx->vnni);
          poison_if_emulated(pl, nkp * kBlockQ, mx->vnni);
          rescale = col_softmax_pack<c10::BFloat16>(st, nk, u.ncols, sc, u.m, u.l, u.lr, ws.alpha, ph, pl);
        } else {
          poison_if_emulated(pp, nkp * kBlockQ, mx->vnni);
          rescale = col_softmax_pack(st, nk, u.ncols, sc, u.m, u.l, u.lr, ws.alpha, pp);
        }
        FM_PHASE(kPhExp);
        if (rescale) col_scale_o(u.o, Dv, u.ncols, ws.alpha);
        FM_PHASE(kPhPack);
        continue;
      }
      // 2c. online softmax down the columns, traversed row by row: the
      // score block (36 KB) is a little larger than L1, and walking it one
      // column chunk at a time (a 384-byte stride) made the exp pass's store
      // the hottest instruction outside the micro-kernels.
      const int64_t nchunks = u.ncols / kW;
      Vec m_new[kBlockQ / kW], m_use[kBlockQ / kW], sum[kBlockQ / kW];
      for (int64_t x = 0; x < nchunks; ++x) m_new[x] = Vec::load(u.m + x * kW);
      for (int64_t j = 0; j < nk; ++j) {
        const float* srow = st + j * kBlockQ;
        for (int64_t x = 0; x < nchunks; ++x) m_new[x] = vmax(m_new[x], Vec::load(srow + x * kW));
      }
      for (int64_t x = 0; x < nchunks; ++x) {
        // A column that has seen only masked keys keeps m = -inf; exponentiate
        // against 0 instead so that exp2(-inf - (-inf)) never makes a NaN.
        m_use[x] = select_eq(m_new[x], Vec::broadcast(kNegInf), Vec::zero(), m_new[x]);
        sum[x] = Vec::zero();
      }
      FM_PHASE(kPhMax);
      for (int64_t j = 0; j < nk; ++j) {
        float* srow = st + j * kBlockQ;
        for (int64_t x = 0; x < nchunks; ++x) {
          const Vec p = exp2_approx(Vec::load(srow + x * kW) - m_use[x]);
          p.store(srow + x * kW);
          sum[x] = sum[x] + p;
        }
      }
      for (int64_t x = 0; x < nchunks; ++x) {
        const Vec alpha = exp2_approx(Vec::load(u.m + x * kW) - m_use[x]);
        fmadd(alpha, Vec::load(u.l + x * kW), sum[x]).store(u.l + x * kW);
        m_new[x].store(u.m + x * kW);
        alpha.store(ws.alpha + x * kW);
      }

      FM_PHASE(kPhExp);
      // 2d. O = alpha * O + P^T V
      if (mx != nullptr) {
        mx_pv_round(st, nk, u.nrows, Dv, ws.alpha, u.o, Dvp, *mx);
        FM_PHASE(kPhPack);
        mx_pv_product(nk, u.nrows, v_mx, ldv_mx, Dv, u.o, Dvp, *mx);
      } else
        pv_block(st, kBlockQ, nk, nk_all, u.nrows, vblk, in_place ? g.v_stride[2] : 0, nvec, ws.alpha, u.o, Dvp);
      FM_PHASE(kPhPV);
    }
  }

  // 3. normalise and write out through the outputs' strides (varlen: views
  // of (total_q, Hq, D) and (Hq, total_q)); split decode: this split's part.
  const int64_t od = g.o_stride[3];
  if (ks != nullptr) {
    const Sub& u = sub[0];  // split calls have one sub-block
    const KeySplitRows r{seq.bi, seq.q0 + u.i0, h0, u.nq, u.nrows, g.q_heads, cols ? kBlockQ : 1, cols ? 1 : Dvp};
    write_key_split(*ks, r, Dv, u.o, u.m, u.l, cols ? u.lr : u.l, out, g.o_stride, lse, g.lse_stride);
    FM_PHASE(kPhOut);
    return;
  }
  for (int64_t s = 0; s < nsub; ++s) {
    const Sub& u = sub[s];
    if (cols && od == 1) {  // the column form: O^T's columns, transposed in registers where it can
      const auto row_of = [&](int64_t c) {
        return out + seq.bi * g.o_stride[0] + (h0 + c / u.nq) * g.o_stride[1] + (seq.q0 + u.i0 + c % u.nq) * g.o_stride[2];
      };
#if defined(FLASH_METAL_COLS_AVX512_BF16)
      if (std::is_same<T, c10::BFloat16>::value)
        col_write_out_16<c10::BFloat16>(u.o, u.nrows, Dv, u.lr,
                                        [&](int64_t c) { return reinterpret_cast<c10::BFloat16*>(row_of(c)); });
      else if (std::is_same<T, c10::Half>::value)
        col_write_out_16<c10::Half>(u.o, u.nrows, Dv, u.lr, [&](int64_t c) { return reinterpret_cast<c10::Half*>(row_of(c)); });
      else
#endif
        col_write_out<T>(u.o, u.nrows, Dv, u.lr, row_of);
      for (int64_t c = 0; c < u.nrows; ++c) {
        const int64_t h = h0 + c / u.nq, i = seq.q0 + u.i0 + c % u.nq;
        float* lrow = lse + seq.bi * g.lse_stride[0] + h * g.lse_stride[1] + i * g.lse_stride[2];
        *lrow = u.l[c] > 0.0f ? kLn2 * (u.m[c] + std::log2(u.l[c])) : kNegInf;
      }
      continue;
    }
    for (int64_t c = 0; c < u.nrows; ++c) {
      const int64_t h = h0 + c / u.nq, i = seq.q0 + u.i0 + c % u.nq;
      T* dst = out + seq.bi * g.o_stride[0] + h * g.o_stride[1] + i * g.o_stride[2];
      float* lrow = lse + seq.bi * g.lse_stride[0] + h * g.lse_stride[1] + i * g.lse_stride[2];
      // O's row c: contiguous, or (column form) column c of O^T
      const float* src = cols ? u.o + c : u.o + c * Dvp;
      const int64_t sd = cols ? kBlockQ : 1;
      const float l = u.l[c];
      if (l > 0.0f) {
        const float inv = 1.0f / l;
        if (od == 1 && sd == 1)  // the usual packed row: a loop the compiler vectorizes
          for (int64_t d = 0; d < Dv; ++d) dst[d] = static_cast<T>(src[d] * inv);
        else
          for (int64_t d = 0; d < Dv; ++d) dst[d * od] = static_cast<T>(src[d * sd] * inv);
        *lrow = kLn2 * (u.m[c] + std::log2(l));
      } else {  // the row sees no key (causal with Nk < Nq, a window, a mask, an empty sequence)
        for (int64_t d = 0; d < Dv; ++d) dst[d * od] = static_cast<T>(0.0f);
        *lrow = kNegInf;
      }
    }
  }
  FM_PHASE(kPhOut);
}


template <typename T>
void run_attention(const Geometry& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                   at::Tensor& lse) {
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  float* lp = lse.mutable_data_ptr<float>();

  // Work decomposition. Short queries pack several heads of a GQA group into
  // one item (see attention_item); otherwise one head and up to
  // kMaxSubBlocks query blocks per item, as many as still leave at least
  // 4 items per thread (so dynamic scheduling can even out causal blocks).
  const int64_t threads_avail = std::max<int64_t>(1, at::get_num_threads());
  const int64_t rows_per_block = std::min(kBlockQ, g.q_len);
  const int64_t heads_per_item = std::max<int64_t>(1, std::min(g.group, kBlockQ / rows_per_block));
  const int64_t head_chunks = (g.group + heads_per_item - 1) / heads_per_item;
  const int64_t lanes = g.batch * g.kv_heads * head_chunks;  // items per query block
  // Query rows per block: kBlockQ, unless that leaves fewer than 2 items per
  // thread (small problems, e.g. B = H = 1, N = 256: 3 blocks of 96 put 2/3
  // of the work on one of 2 threads). Then smaller blocks, a multiple of the
  // vector width and at least 16 rows.
  int64_t bq = kBlockQ;
  if (heads_per_item == 1 && lanes * ((g.q_len + bq - 1) / bq) < 2 * threads_avail) {
    const int64_t want = (g.q_len * lanes + 2 * threads_avail - 1) / (2 * threads_avail);
    bq = std::min(kBlockQ, std::max<int64_t>(16, round_up(want, kG)));
  }
  int64_t q_blocks = (g.q_len + bq - 1) / bq;
  int64_t nsub = std::max<int64_t>(1, std::min<int64_t>(kMaxSubBlocks, lanes * q_blocks / (4 * threads_avail)));
  // Non-causal items all cost the same, so with few of them the item count
  // should be a multiple of the thread count (N = 1024, B = H = 1: 11 blocks
  // of 96 on 2 threads ran 6 + 5; 4 items of 3 x 88 rows run 2 + 2, and pack
  // each K/V block once per 264 queries instead of 96). Pick the fewest items
  // per head that divide evenly and fit kMaxSubBlocks * kBlockQ rows.
  if (!g.causal && !g.opt->window_left && !g.opt->varlen && heads_per_item == 1 && lanes < 4 * threads_avail) {
    int64_t per_lane = 1;
    while (per_lane < g.q_len && ((lanes * per_lane) % threads_avail != 0 ||
                                  (g.q_len + per_lane - 1) / per_lane > kMaxSubBlocks * kBlockQ))
      ++per_lane;
    const int64_t rows_item = (g.q_len + per_lane - 1) / per_lane;
    nsub = (rows_item + kBlockQ - 1) / kBlockQ;
    bq = round_up((rows_item + nsub - 1) / nsub, kG);  // <= kBlockQ, a multiple of kG
    q_blocks = (g.q_len + bq - 1) / bq;
  }
  const int64_t q_items = (q_blocks + nsub - 1) / nsub;
  const int64_t items = lanes * q_items;
  // Split decode (key_split.h): a decode-like call with fewer items than
  // threads spreads each item's keys over S splits, items x S in all.
  const int64_t splits = choose_key_splits(q_blocks == 1, items, threads_avail, g.kv_len);
  KeySplitBuffers ksb(splits, q.size(0) * g.q_heads * q.size(2), g.head_dim_v, items);
  if (splits > 1) count_cpu_key_split();
  const int64_t D = g.head_dim;
  const int64_t Dvp = round_up(g.head_dim_v, kG);

  // Dynamic scheduling: each thread pulls items from a shared counter. Items
  // are ordered last query block first, so under causal masking the most
  // expensive blocks start first and the cheap ones fill the gaps at the end
  // (a static split would give one thread all the long diagonal blocks).
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(threads_avail, items * splits);
  const bool score_opts = g.opt->score_options();
  // The column form of the brgemm path (brgemm_cols.h): with packed operands,
  // for blocks of at least kColMinQueries query columns. V^T is built here,
  // once per call (one pass over V, the size of V: O(N) memory). The split
  // float16 form (brgemm_split.h) exists only as a column form: its shorter
  // blocks (decode) run the vector path, as float16 does without it.
  const bool col_blocks = rows_per_block * heads_per_item >= kColMinQueries;
  // What runs: a split call whose blocks are too short for the column form
  // runs the vector path under auto, and the row form on float16 itself when
  // brgemm is forced or emulated (ATen's non-VNNI products where it cannot
  // pack float16). Counted as it runs, for the tests.
  PathChoice ran = g.path;
  if (ran.split && !col_blocks) {
    if (ran.why == PathWhy::AutoSplitBf16) {
      ran = PathChoice{};
    } else {
      ran.split = false;
      if (ran.vnni == Vnni::Aten) ran.vnni = Vnni::Off;
    }
  }
  count_cpu_path(ran, /*backward=*/false);
  const bool split = ran.split;
  const bool use_mx = ran.path == CpuPath::Brgemm;
  const bool use_cols = use_mx && packs(ran.vnni) && col_blocks;
  AlignedVec<T> vt;  // 64-byte aligned rows (vt_ld is a multiple of 32): the A operand of O^T += V^T P
  const int64_t vt_ld = round_up(v.size(2), 32);
  const int64_t block_k = use_cols ? mx_block_k() : 0;  // read before any work (a bad value is an error)
  SplitOperands so;
  if (split) {
    build_split_operands(kp, g.k_stride, vp, g.v_stride, g.batch, g.kv_heads, k.size(2), g.head_dim, g.head_dim_v, vt_ld,
                         &so);
    count_cpu_split_form();
  }
  if (use_cols) count_cpu_cols_form();
  if (use_cols && !split) {
    vt = AlignedVec<T>();
    vt.resize(g.batch * g.kv_heads * g.head_dim_v * vt_ld, /*zero=*/false);  // build_vt writes every element
    build_vt(vp, g.v_stride, g.batch, g.kv_heads, v.size(2), g.head_dim_v, vt_ld, vt.data());
  }
  run_on_threads(threads, [&](int64_t /*thread*/) {
    Workspace ws(D, Dvp);
    std::unique_ptr<MxBuffers<T>> mx;
    std::unique_ptr<ColBuffers<T>> colbuf;
    if (use_mx) mx.reset(new MxBuffers<T>(kMaxSubBlocks, D, g.head_dim_v, ran.vnni));
    ColForm<T> cf;
    if (use_cols) {
      colbuf.reset(new ColBuffers<T>(kMaxSubBlocks, D, split));
      cf = ColForm<T>{colbuf.get(), vt.data(), vt_ld, block_k};
      if (split) {
        cf.split = true;
        cf.kx = so.kx.data();
        cf.kx_ld = so.kx_ld;
        cf.k_rows = so.k_rows;
        cf.vth = so.vth.data();
        cf.vtl = so.vtl.data();
      }
    }
    for (int64_t job = next.fetch_add(1); job < items * splits; job = next.fetch_add(1)) {
      const int64_t idx = job / splits;
      KeySplit ks_item;
      const KeySplit* ksp = nullptr;
      if (splits > 1) {
        ks_item = KeySplit{splits, job % splits, q.size(0) * g.q_heads * q.size(2), q.size(2), ksb.o.data(),
                           ksb.lse.data(), &ksb.done[idx]};
        ksp = &ks_item;
      }
      const int64_t qi = q_items - 1 - idx / lanes;
      const int64_t lane = idx % lanes;
      const int64_t chunk = lane % head_chunks;
      const int64_t bk = lane / head_chunks;  // b * kv_heads + hk
      const int64_t b = bk / g.kv_heads, hk = bk % g.kv_heads;
      const int64_t h0 = hk * g.group + chunk * heads_per_item;
      const int64_t nh = std::min(heads_per_item, g.group - chunk * heads_per_item);
      if (score_opts)
        attention_item<T, true>(g, qp, kp, vp, op, lp, b, hk, h0, nh, qi * nsub * bq, nsub, bq, ws, mx.get(), cf, ksp);
      else
        attention_item<T, false>(g, qp, kp, vp, op, lp, b, hk, h0, nh, qi * nsub * bq, nsub, bq, ws, mx.get(), cf, ksp);
    }
    if (mx) tile_release(ran.vnni);
  });
}

}  // namespace

void attention_forward(const AttentionCall& c, const AttentionOutputs& o) {
  const AttentionProblem& p = c.p;
  const at::Tensor &q = c.q, &k = c.k, &v = c.v;
  at::Tensor out = o.out4, lse = o.lse3;

  Geometry g;
  g.batch = p.batch;
  g.q_heads = p.q_heads;
  g.kv_heads = p.kv_heads;
  g.q_len = p.q_len;
  g.kv_len = p.kv_len;
  g.head_dim = p.head_dim;
  g.head_dim_v = p.head_dim_v;
  g.group = p.gqa_ratio();
  g.causal = p.causal;
  g.scale_log2 = p.scale_log2();
  for (int d = 0; d < 4; ++d) {
    g.q_stride[d] = q.stride(d);
    g.k_stride[d] = k.stride(d);
    g.v_stride[d] = v.stride(d);
    g.o_stride[d] = out.stride(d);
  }
  for (int d = 0; d < 3; ++d) g.lse_stride[d] = lse.stride(d);
  const CallOptions opt(c);
  g.opt = &opt;
  std::vector<float> sinks2;
  if (p.sinks) {
    sinks2 = sinks_base2(c);
    g.sinks2 = sinks2.data();
  }

  g.path = choose_cpu_path(q.scalar_type(), /*backward=*/false);
  switch (q.scalar_type()) {  // check_attention_inputs admitted only these three
    case at::kFloat: run_attention<float>(g, q, k, v, out, lse); break;
    case at::kHalf: run_attention<c10::Half>(g, q, k, v, out, lse); break;
    case at::kBFloat16: run_attention<c10::BFloat16>(g, q, k, v, out, lse); break;
    default: TORCH_CHECK(false, "flash_metal.attention_forward: unreachable dtype ", q.scalar_type());
  }
}

}  // namespace cpu
}  // namespace flash_metal
