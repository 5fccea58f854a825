// CPU implementation of flash_metal::attention_backward: FlashAttention-2's
// backward pass with recomputation (Dao, "FlashAttention-2", Algorithm 2;
// the same formulas as flash_metal.reference.blockwiseattention_backward).
//
// Per query block (rows i of one query head) and key block (keys j):
//   ST  = K . (Q * scale * log2 e)^T       scores in base 2, transposed (keys x queries)
//   PT  = exp2(ST - lse_i * log2 e)         probabilities rebuilt from the forward's lse
//   dPT = V . dO^T
//   dST = PT o (dPT - Delta_i)              Delta_i = rowsum(dO_i o O_i) - grad_lse_i, float32
//   dV += PT . dO      dK += dST . Q      dQ_i += dST^T . K      (scale applied once at the end)
// Options (common.h): softcap and the attn_mask rebuild the forward's scores,
// dST gains the softcap's factor 1 - tanh^2, key blocks outside the window
// are skipped; varlen items are (sequence, kv head).
// Two head dims (issue 20 §2): ST, dQ and dK run over D_qk (q's and k's),
// dPT, dV and Delta over D_v (v's, dO's, O's); equal but for MLA-style calls.
// The brgemm path (16-bit inputs, matrix_units.h; g.mx) runs the same five
// products through the block GEMM on the 16-bit operands, P and dS rounded to
// the input dtype, the softmax pass unchanged; with VNNI (AMX, or the
// emulated test seam) its B operands are packed once per block and every
// reduction dim padded to even (brgemm_backward.h).
// Five products per tile, all on one register-tiled micro-kernel (the
// forward's 6 x 16 sgemm tile with AVX2/NEON, 6 x 64 with AVX-512):
// C (+)= A . B with B read as
// rows of vectors and A broadcast either row-major or transposed, so every
// operand has one packed layout. Scores stay transposed as in the forward, so
// the per-query quantities (lse, Delta) are vectors along a score row.
//
// Work decomposition: FlashAttention-2's loop order as ATen's CPU flash
// backward runs it (parallel over heads), here over (batch, kv head): one
// item packs K and V of its kv head once (float32, Nk x D), then walks every
// query head of the GQA group and every query block, keeping the block's dQ
// in a small buffer and accumulating dK and dV for all Nk keys in float32
// (Nk x D each). So per thread: O(Nk * D) float32 (packed K, V and the two
// accumulators, 4 * Nk * (D + 16) floats: 10 MB at Nk = 4096, D = 128; with
// GQA 4 * Nk * D more, one head's dK/dV and the group sums' compensations,
// see backward_item) plus fixed ~0.5 MB of blocks; never anything Nq x Nk.
// When B * Hkv items would leave threads idle (B * Hkv not a multiple of the
// thread count and fewer than 4 per thread; e.g. MQA with B = 1), each kv
// head's query rows are cut into C chunks of equal work (causal-aware); a
// chunk owns its dQ rows and writes partial dK/dV for its kv head, and the
// partials are summed afterwards in chunk order. Measured (MQA, B = 1,
// 4:1 heads, N = 2048, D = 64, float32): 2 threads with 2 chunks run 1.96x
// (non-causal) and 1.94x (causal, equal-work chunks) faster than 1 thread.
//
// Deterministic: every gradient element is summed in an order fixed by the
// shapes and the thread count alone (no atomics; dynamic scheduling only
// changes which thread runs an item, never what the item adds or where).
//
// Why this and not the atomics-free split (dK/dV parallel over key blocks, dQ
// parallel over query blocks, as metal-flash-attention and the reference
// oracle do): the split recomputes ST, dPT and the exp pass a second time,
// 7 products instead of 5, and on a CPU nothing (no register file limit, no
// lack of float atomics) forces it: whole heads per item are deterministic
// as they are. Measured with perf on this 2-core Xeon (float32,
// 1 x 4 x 1024 x 64, one thread): the two score products take 25.6% of the
// backward's samples and the exp/dS pass ~7.5%, so the split would cost about
// a third more (an estimate from the profile; the split was not built).
// Figures, one thread, AVX-512 tile, non-causal: 129 GFLOP/s at
// (1, 4, 1024, 64) and 138 GFLOP/s at (1, 2, 1024, 128), counting 5 products;
// MKL's float32 GEMM reaches 160 GFLOP/s at 1024^3 on the same core, so the
// backward runs at ~85% of GEMM speed. With the AVX2 tile it ran ~75 GFLOP/s
// per core. 128-query blocks measured the same as 96 (within 4%).
#include "kernels.h"
#include "backward_tiles.h"
#include "backward_precise.h"
#include "brgemm_backward.h"
#include "common.h"
#include "matrix_units.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace flash_metal {
namespace cpu {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr double kLog2eD = 1.4426950408889634;
constexpr float kInf = std::numeric_limits<float>::infinity();

using namespace bwd;  // tiling constants, the micro-kernel and packing (backward_tiles.h)

// ---------------------------------------------------------------- geometry

struct BwdGeometry {
  int64_t batch, q_heads, kv_heads, q_len, kv_len, group;
  // The two head-dim sides (issue 20 §2; equal but for MLA-style calls):
  // qk = D_qk (Q, K, dQ, dK; the score products), vo = D_v (V, O, dO, dV).
  Width qk, vo;
  bool causal;
  float scale, scale_log2;
  int64_t q_st[4], k_st[4], v_st[4], o_st[4], go_st[4], lse_st[3], glse_st[3];
  bool has_glse;
  const CallOptions* opt;  // window bounds, varlen sequences, mask, softcap (common.h)
  bool mx = false;        // the brgemm path (matrix_units.h): 16-bit products on the block GEMM
  // float32 (backward_precise.h): rows renormalized and Delta their own (a first pass
  // over the keys), softcap scores as hi + lo, blocked score sums; sinks2: the sinks
  // in base 2 (a row's sum includes its sink's P), or nullptr.
  bool precise = false;
  const float* sinks2 = nullptr;
  Vnni vnni = Vnni::Off;  // its B operands' layout (brgemm_backward.h)
};

// Row i of head h of sequence s (its batch index and first row).
template <typename T>
inline const T* row_ptr(const T* base, const int64_t* st, const SeqRange& s, int64_t h, int64_t i, bool k_side) {
  return base + s.bi * st[0] + h * st[1] + ((k_side ? s.k0 : s.q0) + i) * st[2];
}

// Per-thread buffers: the blocks of one query block; with GQA, one query
// head's dK and dV (Nk rows each, folded into the item's sums after each
// head, see backward_item); and, unless the caller provides shared ones (the
// chunked decomposition), packed K and V of one kv head and the item's dK and
// dV sums (Nk rows each) with, under GQA, their compensations.
struct BwdWorkspace {
  // (qk.* for K, dK, Q, dQ; vo.* for V, dV, dO)
  FloatBuffer kr, vr;    // Nk x ld: packed K and V rows
  FloatBuffer dk, dv;    // Nk x Dp: float32 sums over the group
  FloatBuffer ek, ev;    // Nk x Dp: their TwoSum compensations (group > 1)
  FloatBuffer hk, hv;    // Nk x Dp: one query head's dK, dV (group > 1)
  FloatBuffer qt, dot;   // D x kBlockQ: Q (pre-scaled to base-2 scores) and dO, transposed
  FloatBuffer qr, dor;   // kBlockQ x ld: Q and dO rows
  FloatBuffer dq;        // kBlockQ x Dp
  FloatBuffer st, dst;   // kBlockK x kBlockQ: PT and dST
  FloatBuffer dfac;      // kBlockK x kBlockQ: the softcap's 1 - tanh^2 (softcap only)
  FloatBuffer slo;       // kBlockK x kBlockQ: the softcapped scores' remainders (precise softcap only)
  float lse2[kBlockQ], lse2lo[kBlockQ], delta[kBlockQ], delta_o[kBlockQ];
  MxBackward mx;  // the brgemm path's 16-bit operands (empty on the vector path)
  BwdWorkspace(const BwdGeometry& g, bool own_head_buffers) {
    if (g.mx) mx = MxBackward(g.qk.D, g.vo.D, g.vnni);
    const int64_t kk = g.kv_len * g.qk.Dp, kv = g.kv_len * g.vo.Dp;
    if (own_head_buffers) {
      kr.resize(g.kv_len * g.qk.ld);
      vr.resize(g.kv_len * g.vo.ld);
      dk.resize(kk);
      dv.resize(kv);
      if (g.group > 1) {
        ek.resize(kk);
        ev.resize(kv);
      }
    }
    if (g.group > 1) {
      hk.resize(kk);
      hv.resize(kv);
    }
    qt.resize(g.qk.D * kBlockQ);
    dot.resize(g.vo.D * kBlockQ);
    qr.resize(kBlockQ * g.qk.ld);
    dor.resize(kBlockQ * g.vo.ld);
    dq.resize(kBlockQ * g.qk.Dp);
    st.resize(kBlockK * kBlockQ);
    dst.resize(kBlockK * kBlockQ);
    if (g.opt->softcap) dfac.resize(kBlockK * kBlockQ);
    if (g.opt->softcap && g.precise) slo.resize(kBlockK * kBlockQ);
  }
};

struct Tensors {
  const void *go, *q, *k, *v, *o;
  const float *lse, *glse;
  void *gq, *gk, *gv;
};

// Packed K and V of one kv head (Nk rows each, qk.ld and vo.ld apart).
struct PackedHead {
  const float *k, *v;
};

// One item's dK and dV sums over the GQA group (Nk x qk.Dp and Nk x vo.Dp float32) and
// their compensations (nullptr when the group is one head).
struct KVAcc {
  float *dk, *dv, *ek, *ev;
};

// The options of one block of base-2 scores st (kBlockK x kBlockQ, nk keys
// from j0): softcap, the mask, then the window and causality (straddling
// blocks only), as the forward. dfac (optional): the softcap's derivative.
// The precise float32 path keeps the softcapped scores' remainders in ws.slo.
template <typename T, bool ScoreOpts>
void block_options(const BwdGeometry& g, const SeqRange& s, float* st, int64_t nk, int64_t j0, int64_t i0, int64_t nq,
                   const int64_t* moff, BwdWorkspace& ws, float* dfac) {
  const CallOptions& opt = *g.opt;
  const int64_t ncols = round_up(nq, kG);
  if (ScoreOpts && g.precise && opt.softcap) {
    softcap_precise(opt, st, ws.slo.ptr, dfac, kBlockQ, nk, ncols);
    apply_mask_only<T>(opt, st, kBlockQ, nk, nq, moff, j0);
  } else if (ScoreOpts) {
    apply_score_options<T>(opt, st, kBlockQ, nk, ncols, nq, moff, j0, dfac);
  }
  mask_window_block(opt, s, st, kBlockQ, nk, j0, i0, nq, 1);
}

// The precise path's first pass (backward_precise.h): each row's sums of
// its rebuilt P and of P * dP over the keys it sees (and its sink's P);
// log2 of the first joins lse2lo, so the main loop's P of the row sums to
// one, and Delta becomes rowsum(P o dP) / sum - grad_lse, this kernel's own
// (rowsum(dO o O) takes O from the forward, whose P differs from the one
// rebuilt here by both kernels' roundings). Two products per key block
// (K . Q^T, V . dO^T); each block's sums in float32, the blocks' in double.
template <typename T, bool ScoreOpts>
void renormalize_rows(const BwdGeometry& g, const SeqRange& s, int64_t h, PackedHead kv, int64_t i0, int64_t nq,
                      int64_t key_begin, int64_t key_end, const int64_t* moff, BwdWorkspace& ws) {
  const int64_t ncols = round_up(nq, kG), nchunks = ncols / kW, ld = g.qk.ld;
  const bool lo = ScoreOpts && g.opt->softcap;
  double total[kBlockQ] = {}, pdp[kBlockQ] = {};
  alignas(64) float part[kBlockQ], partd[kBlockQ];
  float* st = ws.st.ptr;
  float* dpt = ws.dst.ptr;
  for (int64_t j0 = key_begin; j0 < key_end; j0 += kBlockK) {
    const int64_t nk = std::min(kBlockK, key_end - j0);
    blocked_scores(kv.k + j0 * ld, ld, ws.qt.ptr, kBlockQ, g.qk.D, nk, ncols, st, kBlockQ);  // ST = K . QT
    blocked_scores(kv.v + j0 * g.vo.ld, g.vo.ld, ws.dot.ptr, kBlockQ, g.vo.D, nk, ncols, dpt, kBlockQ);
    block_options<T, ScoreOpts>(g, s, st, nk, j0, i0, nq, moff, ws, nullptr);
    for (int64_t x = 0; x < nchunks; ++x) {
      Vec acc = Vec::zero(), accd = Vec::zero();
      for (int64_t j = 0; j < nk; ++j) {
        const Vec pj = rebuilt_p(st + j * kBlockQ, lo ? ws.slo.ptr + j * kBlockQ : nullptr, ws.lse2, ws.lse2lo, x * kW);
        acc = acc + pj;
        accd = fmadd(pj, Vec::load(dpt + j * kBlockQ + x * kW), accd);
      }
      acc.store(part + x * kW);
      accd.store(partd + x * kW);
    }
    for (int64_t i = 0; i < nq; ++i) {
      total[i] += part[i];
      pdp[i] += partd[i];
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    if (ws.lse2[i] == kInf) continue;  // a row that saw nothing
    if (g.sinks2) total[i] += std::exp2(static_cast<double>(g.sinks2[h]) - ws.lse2[i] - ws.lse2lo[i]);
    if (!(total[i] > 0.0)) continue;
    ws.lse2lo[i] += static_cast<float>(std::log2(total[i]));
    ws.delta[i] += static_cast<float>(pdp[i] / total[i]) - ws.delta_o[i];  // rowsum(P o dP) in place of rowsum(dO o O)
  }
}

// One query block: rows [i0, i0 + nq) of query head h, whose kv head is
// packed in kv. Adds to dk/dv (float32, Nk x Dp) and writes the block's
// grad_q rows.
// Rows are those of sequence s (varlen offsets); kv and dk/dv are indexed by
// the sequence's own key rows. With ScoreOpts, softcap and the mask are
// applied to each score block as in the forward (off: not compiled in).
template <typename T, bool ScoreOpts>
void query_block(const BwdGeometry& g, const Tensors& t, const SeqRange& s, int64_t h, PackedHead kv, int64_t i0,
                 int64_t nq, BwdWorkspace& ws, float* dk, float* dv) {
  const CallOptions& opt = *g.opt;
  const int64_t D = g.qk.D, Dp = g.qk.Dp, ld = g.qk.ld;     // Q, K, dQ, dK
  const int64_t Dv = g.vo.D, Dvp = g.vo.Dp, ldv = g.vo.ld;  // V, O, dO, dV
  const int64_t ncols = round_up(nq, kG);
  T* gq = static_cast<T*>(t.gq) + ((s.bi * g.q_heads + h) * opt.rows_q + s.q0 + i0) * D;
  const int64_t key_end = opt.key_end(s, i0 + nq);
  // The left window: key blocks wholly before the first row's bound are skipped.
  const int64_t key_begin = opt.key_begin(s, i0);
  if (key_end <= key_begin) {  // these rows see no key (causal with Nk < Nq, a window, an empty sequence)
    std::fill(gq, gq + nq * D, static_cast<T>(0.0f));
    return;
  }
  const T* q = row_ptr(static_cast<const T*>(t.q), g.q_st, s, h, i0, false);
  const T* go = row_ptr(static_cast<const T*>(t.go), g.go_st, s, h, i0, false);
  const T* o = row_ptr(static_cast<const T*>(t.o), g.o_st, s, h, i0, false);
  const int64_t lrow0 = s.bi * g.lse_st[0] + h * g.lse_st[1] + (s.q0 + i0) * g.lse_st[2];
  const int64_t grow0 = s.bi * g.glse_st[0] + h * g.glse_st[1] + (s.q0 + i0) * g.glse_st[2];
  int64_t moff[kBlockQ];
  if (ScoreOpts && opt.mask != MaskKind::None)
    for (int64_t i = 0; i < nq; ++i) moff[i] = s.bi * opt.ms[0] + h * opt.ms[1] + (i0 + i) * opt.ms[2];
  pack_transposed(q, g.q_st, nq, g.scale_log2, g.qk, ws.qt.ptr);
  pack_transposed(go, g.go_st, nq, 1.0f, g.vo, ws.dot.ptr);
  pack_rows(q, g.q_st, nq, g.qk, ws.qr.ptr);
  pack_rows(go, g.go_st, nq, g.vo, ws.dor.ptr);
  if (g.mx) ws.mx.load_query(q, g.q_st, go, g.go_st, nq, ncols);  // brgemm path: QT, dOT, Q, dO in T
  float orow[kMaxHeadDim];
  for (int64_t i = 0; i < nq; ++i) {
    const float lse = t.lse[lrow0 + i * g.lse_st[2]];
    // A row that saw no key has lse = -inf; +inf makes its P = exp2(s - inf) = 0.
    // lse * log2 e as hi + lo: the product's float32 rounding (up to half an
    // ulp of ~lse * 1.44, a relative error of P up to 4e-7 at lse ~ 10) would
    // otherwise shift every P of the row; the forward's exp2(s - max) has no
    // such term. lo is the double-precision remainder, subtracted second.
    const float hi = lse == -kInf ? kInf : lse * kLog2e;
    ws.lse2[i] = hi;
    ws.lse2lo[i] = lse == -kInf ? 0.0f : static_cast<float>(static_cast<double>(lse) * kLog2eD - hi);
    convert_row(o + i * g.o_st[2], g.o_st[3], Dv, orow);
    const float* dorow = ws.dor.ptr + i * ldv;
    float acc = 0.0f;  // Delta = rowsum(dO o O): over D_v
    for (int64_t d = 0; d < Dv; ++d) acc += dorow[d] * orow[d];
    ws.delta_o[i] = acc;
    if (g.has_glse) acc -= t.glse[grow0 + i * g.glse_st[2]];
    ws.delta[i] = acc;
  }
  for (int64_t i = nq; i < ncols; ++i) {  // padding columns: P = 0, dS = 0
    ws.lse2[i] = kInf;
    ws.lse2lo[i] = 0.0f;
    ws.delta[i] = 0.0f;
  }
  // The first pass is for large logits (backward_precise.h): P's error from
  // the forward's float32 lse is half an ulp of |lse|, one factor on every P
  // of the row. Below kRenormLse that is at most 4.8e-7 (ulp(12) / 2), the
  // size of float32's own roundings in PyTorch's backward, so rows whose
  // |lse| all stay below it skip the pass (~40% of the float32 backward), and
  // a softcap keeps it (its logits sit at the cap).
  float lse_mag = 0.0f;
  for (int64_t i = 0; i < nq; ++i)
    if (ws.lse2[i] != kInf) lse_mag = std::max(lse_mag, std::fabs(ws.lse2[i]) * 0.69314718f);  // |lse2| ln 2 = |lse|
  const bool renorm = g.precise && ((ScoreOpts && opt.softcap) || lse_mag > kRenormLse || g.sinks2 != nullptr);
  if (renorm) {
    count_cpu_renormalized_block();
    renormalize_rows<T, ScoreOpts>(g, s, h, kv, i0, nq, key_begin, key_end, moff, ws);
  }
  std::fill(ws.dq.ptr, ws.dq.ptr + nq * Dp, 0.0f);

  float* st = ws.st.ptr;
  float* dst = ws.dst.ptr;
  const int64_t nchunks = ncols / kW;
  for (int64_t j0 = key_begin; j0 < key_end; j0 += kBlockK) {
    const int64_t nk = std::min(kBlockK, key_end - j0);
    const float* kb = kv.k + j0 * ld;
    if (g.mx) {  // ST = K . QT, dPT = V . dOT on the block GEMM
      const int64_t hk = h / g.group;
      ws.mx.load_keys(row_ptr(static_cast<const T*>(t.k), g.k_st, s, hk, j0, true), g.k_st,
                      row_ptr(static_cast<const T*>(t.v), g.v_st, s, hk, j0, true), g.v_st, nk);
      ws.mx.scores<T>(nk, ncols, g.scale_log2, st, dst);
    } else if (g.precise) {  // blocked sums (backward_precise.h)
      blocked_scores(kb, ld, ws.qt.ptr, kBlockQ, D, nk, ncols, st, kBlockQ);                // ST = K . QT
      blocked_scores(kv.v + j0 * ldv, ldv, ws.dot.ptr, kBlockQ, Dv, nk, ncols, dst, kBlockQ);  // dPT = V . dOT
    } else {
      matmul<false, false>(kb, ld, ws.qt.ptr, kBlockQ, D, nk, ncols, st, kBlockQ);           // ST = K . QT
      matmul<false, false>(kv.v + j0 * ldv, ldv, ws.dot.ptr, kBlockQ, Dv, nk, ncols, dst, kBlockQ);  // dPT = V . dOT
    }
    block_options<T, ScoreOpts>(g, s, st, nk, j0, i0, nq, moff, ws, ws.dfac.ptr);
    for (int64_t j = 0; j < nk; ++j) {
      float* srow = st + j * kBlockQ;
      float* drow = dst + j * kBlockQ;
      const float* lorow = ScoreOpts && g.precise && opt.softcap ? ws.slo.ptr + j * kBlockQ : nullptr;
      for (int64_t x = 0; x < nchunks; ++x) {
        const Vec p = rebuilt_p(srow, lorow, ws.lse2, ws.lse2lo, x * kW);
        p.store(srow + x * kW);
        (p * (Vec::load(drow + x * kW) - Vec::load(ws.delta + x * kW))).store(drow + x * kW);
      }
      if (ScoreOpts && opt.softcap) {  // dS_raw = dS * (1 - tanh^2): the softcap's exact derivative
        const float* frow = ws.dfac.ptr + j * kBlockQ;
        for (int64_t x = 0; x < nchunks; ++x)
          (Vec::load(drow + x * kW) * Vec::load(frow + x * kW)).store(drow + x * kW);
      }
    }
    if (g.mx) {  // P and dS rounded to T (FlashAttention's choice), then dV, dK, dQ on the block GEMM
      ws.mx.grads<T>(st, dst, nk, nq, dv + j0 * Dvp, Dvp, dk + j0 * Dp, Dp, ws.dq.ptr, Dp);
      continue;
    }
    matmul<false, true>(st, kBlockQ, ws.dor.ptr, ldv, nq, nk, Dvp, dv + j0 * Dvp, Dvp);  // dV += PT . dO
    matmul<false, true>(dst, kBlockQ, ws.qr.ptr, ld, nq, nk, Dp, dk + j0 * Dp, Dp);  // dK += dST . Q
    matmul<true, true>(dst, kBlockQ, kb, ld, nk, nq, Dp, ws.dq.ptr, Dp);             // dQ += dST^T . K
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t d = 0; d < D; ++d) gq[i * D + d] = static_cast<T>(ws.dq.ptr[i * Dp + d] * g.scale);
}

// Keys [j0, j1) of kv head hk of sequence s -> rows of kr and vr.
template <typename T>
void pack_head(const BwdGeometry& g, const Tensors& t, const SeqRange& s, int64_t hk, int64_t j0, int64_t j1,
               float* kr, float* vr) {
  pack_rows(row_ptr(static_cast<const T*>(t.k), g.k_st, s, hk, j0, true), g.k_st, j1 - j0, g.qk, kr + j0 * g.qk.ld);
  pack_rows(row_ptr(static_cast<const T*>(t.v), g.v_st, s, hk, j0, true), g.v_st, j1 - j0, g.vo, vr + j0 * g.vo.ld);
}

// sum[0, n) += x[0, n) by TwoSum, the rounding errors added to comp.
void fold_two_sum(float* sum, float* comp, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += kW) {  // n is a multiple of a padded width (Dp), so of kW
    Vec e = Vec::load(comp + i);
    two_sum(Vec::load(sum + i), Vec::load(x + i), &e).store(sum + i);
    e.store(comp + i);
  }
}

// One item: query rows [r0, r1) of every query head of kv head hk, sequence s.
// acc (the sequence's Nk x qk.Dp and Nk x vo.Dp) is zeroed here and holds this item's sums afterwards.
//
// The sum over the GQA group (issue 24). The kernel used to continue one fma
// chain per dK/dV element through every row of every query head of the
// group (32768 roundings at 32 heads of 1024 rows, each at the size of the
// whole sum). Measured against PyTorch's float32 backward (the 2x rule's
// yardstick; B = 1, N = 1024, D = 40 and 64, causal and not), dK's error was
// 1.4-2.4x PyTorch's at 1 query head per kv head and 6.6-11x at 32. Now
// each 96-row block is summed from zero and added once (mm_tile), and each
// query head on its own: the first straight into acc, every further one
// into ws.hk/hv, then folded into acc by TwoSum with the rounding error kept
// in acc.ek/ev (Knuth, TAOCP 4.2.2; Neumaier's compensated summation), so
// the group adds about one float32 rounding however many heads it has
// (equal heads sum exactly: tests/api/test_gqa_backward_precision.py). dK and
// dV then measured 0.4-1.7x PyTorch's error at 1 to 32 heads per kv head;
// the blocked sums alone, one accumulator for the group, still grew to
// 1.5-1.7x at 32. Costs 2 more Nk x Dp buffers per thread and per item (the
// head's sums and the compensations) and one pass over them per head,
// against the head's Nq x Nk x D products (no measurable time).
template <typename T>
void backward_item(const BwdGeometry& g, const Tensors& t, const SeqRange& s, int64_t hk, int64_t r0, int64_t r1,
                   PackedHead kv, BwdWorkspace& ws, const KVAcc& acc) {
  const int64_t n = s.nk * g.qk.Dp, nv = s.nk * g.vo.Dp;  // dK's and dV's floats
  for (float* x : {acc.dk, acc.ek})
    if (x != nullptr) std::fill(x, x + n, 0.0f);
  for (float* x : {acc.dv, acc.ev})
    if (x != nullptr) std::fill(x, x + nv, 0.0f);
  const bool score_opts = g.opt->score_options();
  for (int64_t h = hk * g.group; h < (hk + 1) * g.group; ++h) {
    const bool first = h == hk * g.group;
    float* dk = first ? acc.dk : ws.hk.ptr;
    float* dv = first ? acc.dv : ws.hv.ptr;
    if (!first) {
      std::fill(dk, dk + n, 0.0f);
      std::fill(dv, dv + nv, 0.0f);
    }
    for (int64_t i0 = r0; i0 < r1; i0 += kBlockQ) {
      if (score_opts)
        query_block<T, true>(g, t, s, h, kv, i0, std::min(kBlockQ, r1 - i0), ws, dk, dv);
      else
        query_block<T, false>(g, t, s, h, kv, i0, std::min(kBlockQ, r1 - i0), ws, dk, dv);
    }
    if (!first) {
      fold_two_sum(acc.dk, acc.ek, dk, n);
      fold_two_sum(acc.dv, acc.ev, dv, nv);
    }
  }
}

// Rows [j0, j1) of one gradient (w.D wide, packed) = mul * the sums of
// `parts` partials `stride` floats apart (rows w.Dp apart), added in order by
// TwoSum, each with its compensation (comp, if any) added last.
template <typename T>
void write_sum(T* out, const float* sum, const float* comp, const Width& w, int64_t j0, int64_t j1, int64_t parts,
               int64_t stride, float mul) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t d = 0; d < w.D; ++d) {
      const int64_t x = j * w.Dp + d;
      float s = sum[x], e = 0.0f;
      for (int64_t c = 1; c < parts; ++c) s = two_sum(s, sum[c * stride + x], &e);
      for (int64_t c = 0; comp != nullptr && c < parts; ++c) e += comp[c * stride + x];
      out[j * w.D + d] = static_cast<T>((s + e) * mul);
    }
}

// grad_k/grad_v rows [j0, j1) of kv head hk of sequence s = scale * dk, dv:
// the sums of `parts` partial KVAccs (stride_k / stride_v floats apart).
template <typename T>
void write_kv(const BwdGeometry& g, const Tensors& t, const SeqRange& s, int64_t hk, int64_t j0, int64_t j1,
              const KVAcc& acc, int64_t parts, int64_t stride_k, int64_t stride_v) {
  const int64_t row0 = (s.bi * g.kv_heads + hk) * g.opt->rows_k + s.k0;
  write_sum(static_cast<T*>(t.gk) + row0 * g.qk.D, acc.dk, acc.ek, g.qk, j0, j1, parts, stride_k, g.scale);
  write_sum(static_cast<T*>(t.gv) + row0 * g.vo.D, acc.dv, acc.ev, g.vo, j0, j1, parts, stride_v, 1.0f);
}

// Query-row boundaries (multiples of kBlockQ) cutting sequence s's [0, Nq)
// into `chunks` pieces of about equal work; work of a block ~ rows x visible keys.
std::vector<int64_t> chunk_bounds(const BwdGeometry& g, const SeqRange& s, int64_t chunks) {
  std::vector<int64_t> starts, cost;
  for (int64_t i0 = 0; i0 < s.nq; i0 += kBlockQ) {
    const int64_t nq = std::min(kBlockQ, s.nq - i0);
    starts.push_back(i0);
    cost.push_back(nq * std::max<int64_t>(1, g.opt->key_end(s, i0 + nq) - g.opt->key_begin(s, i0)));
  }
  const double total = std::accumulate(cost.begin(), cost.end(), 0.0);
  std::vector<int64_t> bounds = {0};
  double run = 0.0;
  for (size_t x = 0; x < starts.size(); ++x) {
    const int64_t c = static_cast<int64_t>(bounds.size());  // the chunk being filled
    if (c < chunks && x > 0 && run + cost[x] / 2.0 > total * c / chunks) bounds.push_back(starts[x]);
    run += cost[x];
  }
  while (static_cast<int64_t>(bounds.size()) < chunks) bounds.push_back(s.nq);
  bounds.push_back(s.nq);
  return bounds;
}

template <typename T>
void run_backward(const BwdGeometry& g, const Tensors& t) {
  const int64_t threads_avail = std::max<int64_t>(1, at::get_num_threads());
  const int64_t heads = g.batch * g.kv_heads;
  // Chunks per kv head: 1 when the heads alone spread evenly (a multiple of
  // the thread count, or at least 4 per thread, where dynamic scheduling
  // evens out the remainder to within 25%); otherwise the fewest chunks that
  // make the item count a multiple of the thread count, at most one per
  // query block.
  int64_t chunks = 1;
  if (heads % threads_avail != 0 && heads < 4 * threads_avail) {
    chunks = threads_avail / std::gcd(heads, threads_avail);
    chunks = std::max<int64_t>(1, std::min(chunks, (g.q_len + kBlockQ - 1) / kBlockQ));
  }
  const int64_t items = heads * chunks;
  const int64_t threads = std::min(threads_avail, items);
  std::atomic<int64_t> next{0};
  if (chunks == 1) {
    run_on_threads(threads, [&](int64_t) {
      BwdWorkspace ws(g, true);
      for (int64_t idx = next.fetch_add(1); idx < items; idx = next.fetch_add(1)) {
        const int64_t b = idx / g.kv_heads, hk = idx % g.kv_heads;
        const SeqRange s = g.opt->seq(b);
        pack_head<T>(g, t, s, hk, 0, g.opt->key_end(s, s.nq), ws.kr.ptr, ws.vr.ptr);
        const KVAcc acc{ws.dk.ptr, ws.dv.ptr, ws.ek.ptr, ws.ev.ptr};
        backward_item<T>(g, t, s, hk, 0, s.nq, {ws.kr.ptr, ws.vr.ptr}, ws, acc);
        write_kv<T>(g, t, s, hk, 0, s.nk, acc, 1, 0, 0);
      }
      tile_release(g.vnni);
    });
    return;
  }
  // Chunked: K and V of every kv head packed once, shared by its chunks, and
  // partial dK/dV per (kv head, chunk): heads < 4 * threads here, so
  // heads * Nk * (qk.ld + vo.ld + chunks * (qk.Dp + vo.Dp)) floats in all,
  // and as much again as the chunks' part for the compensations under GQA.
  std::vector<std::vector<int64_t>> bounds;  // per sequence
  for (int64_t b = 0; b < g.batch; ++b) bounds.push_back(chunk_bounds(g, g.opt->seq(b), chunks));
  const int64_t key_blocks = (g.kv_len + kBlockK - 1) / kBlockK;
  const int64_t red_items = heads * key_blocks;  // (kv head, key block) pairs
  const int64_t head_k = g.kv_len * g.qk.ld, head_v = g.kv_len * g.vo.ld;  // floats per packed head
  FloatBuffer kr, vr;
  kr.resize(heads * head_k);
  vr.resize(heads * head_v);
  std::atomic<int64_t> pack_next{0};
  run_on_threads(std::min(threads_avail, red_items), [&](int64_t) {
    for (int64_t idx = pack_next.fetch_add(1); idx < red_items; idx = pack_next.fetch_add(1)) {
      const int64_t bhk = idx / key_blocks, j0 = (idx % key_blocks) * kBlockK;
      const SeqRange s = g.opt->seq(bhk / g.kv_heads);
      const int64_t j1 = std::min(g.opt->key_end(s, s.nq), j0 + kBlockK);
      if (j0 < j1)
        pack_head<T>(g, t, s, bhk % g.kv_heads, j0, j1, kr.ptr + bhk * head_k, vr.ptr + bhk * head_v);
    }
  });
  const int64_t part_k = g.kv_len * g.qk.Dp, part_v = g.kv_len * g.vo.Dp;  // floats per item's dK, dV
  const size_t all_k = static_cast<size_t>(items * part_k), all_v = static_cast<size_t>(items * part_v);
  std::vector<float> pk(all_k), pv(all_v), ek(g.group > 1 ? all_k : 0), ev(g.group > 1 ? all_v : 0);
  const auto partial = [&](int64_t i) {  // item i's KVAcc
    const auto at = [&](std::vector<float>& x, int64_t part) { return x.empty() ? nullptr : x.data() + i * part; };
    return KVAcc{at(pk, part_k), at(pv, part_v), at(ek, part_k), at(ev, part_v)};
  };
  run_on_threads(threads, [&](int64_t) {
    BwdWorkspace ws(g, false);
    for (int64_t idx = next.fetch_add(1); idx < items; idx = next.fetch_add(1)) {
      const int64_t bhk = idx / chunks, c = idx % chunks;
      const int64_t b = bhk / g.kv_heads;
      const PackedHead kv{kr.ptr + bhk * head_k, vr.ptr + bhk * head_v};
      backward_item<T>(g, t, g.opt->seq(b), bhk % g.kv_heads, bounds[b][c], bounds[b][c + 1], kv, ws,
                       partial(idx));
    }
    tile_release(g.vnni);
  });
  // Sum the chunks in order, in parallel over (kv head, key block).
  std::atomic<int64_t> red_next{0};
  run_on_threads(std::min(threads_avail, red_items), [&](int64_t) {
    for (int64_t idx = red_next.fetch_add(1); idx < red_items; idx = red_next.fetch_add(1)) {
      const int64_t bhk = idx / key_blocks, j0 = (idx % key_blocks) * kBlockK;
      const SeqRange s = g.opt->seq(bhk / g.kv_heads);
      if (j0 < s.nk)
        write_kv<T>(g, t, s, bhk % g.kv_heads, j0, std::min(s.nk, j0 + kBlockK), partial(bhk * chunks), chunks,
                    part_k, part_v);
    }
  });
}

}  // namespace

void attention_backward(const AttentionCall& c, const BackwardTensors& bt, const AttentionGradients& grads) {
  const AttentionProblem& p = c.p;
  const at::Tensor &q = c.q, &k = c.k, &v = c.v, &out = bt.out4, &lse = bt.lse3, &grad_out = bt.grad_out4;
  const std::optional<at::Tensor> grad_lse =
      bt.grad_lse3.defined() ? std::optional<at::Tensor>(bt.grad_lse3) : std::nullopt;
  const at::Tensor &grad_q = grads.grad_q4, &grad_k = grads.grad_k4, &grad_v = grads.grad_v4;

  BwdGeometry g;
  g.batch = p.batch;
  g.q_heads = p.q_heads;
  g.kv_heads = p.kv_heads;
  g.q_len = p.q_len;
  g.kv_len = p.kv_len;
  g.qk = Width(p.head_dim);
  g.vo = Width(p.head_dim_v);
  g.group = p.gqa_ratio();
  g.causal = p.causal;
  const CallOptions opt(c);
  g.opt = &opt;
  g.scale = static_cast<float>(p.scale);
  g.scale_log2 = p.scale_log2();
  g.has_glse = grad_lse.has_value() && grad_lse->defined();
  for (int d = 0; d < 4; ++d) {
    g.q_st[d] = q.stride(d);
    g.k_st[d] = k.stride(d);
    g.v_st[d] = v.stride(d);
    g.o_st[d] = out.stride(d);
    g.go_st[d] = grad_out.stride(d);
  }
  for (int d = 0; d < 3; ++d) {
    g.lse_st[d] = lse.stride(d);
    g.glse_st[d] = g.has_glse ? grad_lse->stride(d) : 0;
  }
  Tensors t{grad_out.const_data_ptr(), q.const_data_ptr(), k.const_data_ptr(), v.const_data_ptr(),
            out.const_data_ptr(), lse.const_data_ptr<float>(),
            g.has_glse ? grad_lse->const_data_ptr<float>() : nullptr, grad_q.mutable_data_ptr(),
            grad_k.mutable_data_ptr(), grad_v.mutable_data_ptr()};

  const PathChoice path = choose_cpu_path(q.scalar_type(), /*backward=*/true);
  count_cpu_path(path, /*backward=*/true);
  g.mx = path.path == CpuPath::Brgemm;
  g.vnni = g.mx ? path.vnni : Vnni::Off;
  g.precise = q.scalar_type() == at::kFloat && !g.mx;  // backward_precise.h: float32's own rounding is the issue
  const std::vector<float> sinks2 = p.sinks && g.precise ? sinks_base2(c) : std::vector<float>();
  g.sinks2 = sinks2.empty() ? nullptr : sinks2.data();
  switch (q.scalar_type()) {  // check_backward_inputs admitted only these three
    case at::kFloat: run_backward<float>(g, t); break;
    case at::kHalf: run_backward<c10::Half>(g, t); break;
    case at::kBFloat16: run_backward<c10::BFloat16>(g, t); break;
    default: TORCH_CHECK(false, "flash_metal.attention_backward: unreachable dtype ", q.scalar_type());
  }
}

}  // namespace cpu
}  // namespace flash_metal
