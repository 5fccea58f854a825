// attention_kvcache on CPU reading a quantized cache in place (issue 44):
// decode, split-KV decode, paged decode and chunked prefill (Nq up to a few
// hundred) in one kernel. Codes and scales are read through the block
// table; each key row is converted in registers (kv_dequant.h) and used at
// once, so no dequantized K or V is ever written.
//
// Work: one unit per (sequence b, kv head, tile of query columns, key
// split). A tile's columns are the GQA group's query heads times a few
// query rows (column c: head h0 + c / R, row r0 + c % R), at most kMaxCols
// of them, so each K/V element converted serves every column of the tile:
//   scores  for each key: acc[c] += k_chunk * q[c] over D (acc in registers,
//           one horizontal sum per key and column), then the format's
//           factor (int8: the token's scale; fp8: the descale, folded into q;
//           4-bit: scale and bias applied to the chunk, one FMA, before the
//           products);
//   softmax online, per column, in base 2 (exp2_approx), with softcap,
//           causal / window bounds and sinks as the float kernels apply them;
//   values  for each chunk of D_v: o[c] (registers) += w[c][j] * v_chunk_j
//           over the block's keys, w = P (int8: P times the token's scale).
// Split-KV (few units, long caches: decode at B = 1): each split keeps its
// own (m, l, O); they merge through their log-sum-exp at the end.
//
// Why these sizes: kKeyBlock = 64 keys per softmax step (the scores of a tile
// stay in 4 KiB); kMaxCols = 16 columns with 32 vector registers (AVX-512:
// 16 accumulators + the converted chunk + q), 8 with 16 (AVX2).
#include "kvcache_quant_cpu.h"

// GCC 12's AVX-512 headers build _mm512_cvtph_ps and _mm512_reduce_add_ps
// on _mm512_undefined_*(), a self-initialised variable, which
// -Wmaybe-uninitialized reports at every use: a false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "common.h"
#include "kernels.h"
#include "kv_dequant.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

namespace flash_metal {
namespace cpu {
namespace {

constexpr int kKeyBlock = 64;
constexpr int kMaxCols = kQW >= 8 ? kQW : 8;  // 16 with AVX-512, 8 with AVX2 (and NEON / scalar)

std::atomic<int64_t> g_counts[2 * kNumCodeFmts + 2];  // calls per K format, per V format; split calls; units

// One side of the cache as the kernel reads it.
struct Side {
  CodeFmt fmt = CodeFmt::F32;
  const uint8_t* base = nullptr;
  int64_t s_blk = 0, s_row = 0, s_head = 0;  // bytes
  int64_t D = 0, gs = 0, groups = 0;
  // Int8: float32 scale; Q4: scale and bias; strides in elements (block, row, head, group).
  const void* scale = nullptr;
  const void* bias = nullptr;
  at::ScalarType sdt = at::kFloat;
  int64_t ss[4] = {0, 0, 0, 0}, bs[4] = {0, 0, 0, 0};
  // Fp8: the descale per (batch, kv head) or per tensor.
  const float* descale = nullptr;
  int64_t ds[2] = {0, 0};

  float fp8_descale(int64_t b, int64_t h) const { return descale[b * ds[0] + h * ds[1]]; }
};

inline float read_float(const void* p, at::ScalarType t, int64_t i) {
  if (t == at::kFloat) return static_cast<const float*>(p)[i];
  if (t == at::kHalf) return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
  return static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
}

CodeFmt code_fmt(const KvSide& s) {
  switch (s.format) {
    case KvFormat::Int8: return CodeFmt::I8;
    case KvFormat::Q4: return CodeFmt::Q4;
    case KvFormat::Fp8: return CodeFmt::F8;
    case KvFormat::Native: break;
  }
  const auto t = s.codes.scalar_type();
  return t == at::kFloat ? CodeFmt::F32 : t == at::kHalf ? CodeFmt::F16 : CodeFmt::BF16;
}

Side make_side(const KvSide& s) {
  Side r;
  r.fmt = code_fmt(s);
  const at::Tensor& c = s.codes;
  const int64_t es = c.element_size();
  r.base = static_cast<const uint8_t*>(c.const_data_ptr());
  r.s_blk = c.stride(0) * es;
  r.s_row = c.stride(1) * es;
  r.s_head = c.stride(2) * es;
  r.D = s.format == KvFormat::Native ? c.size(3) : s.head_dim;
  r.gs = s.group_size;
  r.groups = s.groups;
  if (s.format == KvFormat::Int8 || s.format == KvFormat::Q4) {
    r.scale = s.scale.const_data_ptr();
    r.sdt = s.scale.scalar_type();
    for (int d = 0; d < s.scale.dim(); ++d) r.ss[d] = s.scale.stride(d);
  }
  if (s.format == KvFormat::Q4) {
    r.bias = s.bias.const_data_ptr();
    for (int d = 0; d < s.bias.dim(); ++d) r.bs[d] = s.bias.stride(d);
  }
  if (s.format == KvFormat::Fp8) {
    r.descale = s.scale.const_data_ptr<float>();
    if (!s.per_tensor) {
      r.ds[0] = s.scale.stride(0);
      r.ds[1] = s.scale.stride(1);
    }
  }
  return r;
}

// ---------------------------------------------------------------- micro-kernels

// S[c * kKeyBlock + j] = q[c] . k_j over D for the block's nk keys (4-bit:
// k_j's groups scaled and biased in registers: gsc / gbi[j * groups + g]).
// kQW / NC keys per step, so that kQW accumulators (keys x columns) reduce
// in one shuffle tree (reduce_lanes). A step's keys past nk repeat key 0
// and their sums are dropped.
// (More columns than lanes, NEON / scalar builds: one key at a time, one
// horizontal sum per column.)
template <CodeFmt F, int NC>
void score_block_per_key(const uint8_t* const* rows, int nk, const float* qp, int64_t ldq, int64_t D,
                         const float* gsc, const float* gbi, int64_t groups, int64_t gs, float* S) {
  for (int j = 0; j < nk; ++j) {
    QV acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = QV::zero();
    for (int64_t d = 0; d < D; d += kQW) {
      QV kv = d + kQW <= D ? load_codes<F>(rows[j], d) : load_tail<F>(rows[j], d, D - d);
      if (F == CodeFmt::Q4) {
        const int64_t g = j * groups + d / gs;
        kv = fmadd(kv, QV::broadcast(gsc[g]), QV::broadcast(gbi[g]));
      }
      for (int c = 0; c < NC; ++c) acc[c] = fmadd(kv, QV::load(qp + c * ldq + d), acc[c]);
    }
    for (int c = 0; c < NC; ++c) S[c * kKeyBlock + j] = hsum(acc[c]);
  }
}

template <CodeFmt F, int NC>
void score_block(const uint8_t* const* rows, int nk, const float* qp, int64_t ldq, int64_t D, const float* gsc,
                 const float* gbi, int64_t groups, int64_t gs, float* S) {
  if constexpr (NC > kQW || kQW < 8) {
    score_block_per_key<F, NC>(rows, nk, qp, ldq, D, gsc, gbi, groups, gs, S);
    return;
  }
  constexpr int KS = NC <= kQW ? kQW / NC : 1;
  const int* perm = reduce_lanes_perm();
  for (int j0 = 0; j0 < nk; j0 += KS) {
    const uint8_t* r[KS];
    int64_t gbase[KS];
    for (int kk = 0; kk < KS; ++kk) {
      const int j = j0 + kk < nk ? j0 + kk : 0;
      r[kk] = rows[j];
      gbase[kk] = j * groups;
    }
    QV acc[kQW];
    for (int i = 0; i < kQW; ++i) acc[i] = QV::zero();
    for (int64_t d = 0; d < D; d += kQW) {
      const bool full = d + kQW <= D;
      for (int kk = 0; kk < KS; ++kk) {
        QV kv = full ? load_codes<F>(r[kk], d) : load_tail<F>(r[kk], d, D - d);
        if (F == CodeFmt::Q4) {
          const int64_t g = gbase[kk] + d / gs;
          kv = fmadd(kv, QV::broadcast(gsc[g]), QV::broadcast(gbi[g]));
        }
        for (int c = 0; c < NC; ++c) acc[kk * NC + c] = fmadd(kv, QV::load(qp + c * ldq + d), acc[kk * NC + c]);
      }
    }
    alignas(64) float sums[kQW];
    reduce_lanes(acc, sums);
    for (int kk = 0; kk < KS && j0 + kk < nk; ++kk)
      for (int c = 0; c < NC; ++c) S[c * kKeyBlock + j0 + kk] = sums[perm[kk * NC + c]];
  }
}

// O[c * ldo + d] += sum_j W[c * kKeyBlock + j] * v_j[d], chunk by chunk of D_v.
template <CodeFmt F, int NC>
void value_block(const uint8_t* const* rows, int nk, const float* W, int64_t Dv, const float* gsc, const float* gbi,
                 int64_t groups, int64_t gs, float* O, int64_t ldo) {
  for (int64_t d = 0; d < Dv; d += kQW) {
    QV o[NC];
    for (int c = 0; c < NC; ++c) o[c] = QV::load(O + c * ldo + d);
    const bool full = d + kQW <= Dv;
    for (int j = 0; j < nk; ++j) {
      QV vv = full ? load_codes<F>(rows[j], d) : load_tail<F>(rows[j], d, Dv - d);
      if (F == CodeFmt::Q4) {
        const int64_t g = j * groups + d / gs;
        vv = fmadd(vv, QV::broadcast(gsc[g]), QV::broadcast(gbi[g]));
      }
      for (int c = 0; c < NC; ++c) o[c] = fmadd(QV::broadcast(W[c * kKeyBlock + j]), vv, o[c]);
    }
    for (int c = 0; c < NC; ++c) o[c].store(O + c * ldo + d);
  }
}

using ScoreFn = void (*)(const uint8_t* const*, int, const float*, int64_t, int64_t, const float*, const float*,
                         int64_t, int64_t, float*);
using ValueFn = void (*)(const uint8_t* const*, int, const float*, int64_t, const float*, const float*, int64_t,
                         int64_t, float*, int64_t);

template <CodeFmt F>
ScoreFn score_fn(int nc) {
  if (nc <= 1) return &score_block<F, 1>;
  if (nc <= 2) return &score_block<F, 2>;
  if (nc <= 4) return &score_block<F, 4>;
  if (nc <= 8) return &score_block<F, 8>;
  return &score_block<F, kMaxCols>;
}
template <CodeFmt F>
ValueFn value_fn(int nc) {
  if (nc <= 1) return &value_block<F, 1>;
  if (nc <= 2) return &value_block<F, 2>;
  if (nc <= 4) return &value_block<F, 4>;
  if (nc <= 8) return &value_block<F, 8>;
  return &value_block<F, kMaxCols>;
}
ScoreFn pick_score(CodeFmt f, int nc) {
  switch (f) {
    case CodeFmt::F32: return score_fn<CodeFmt::F32>(nc);
    case CodeFmt::F16: return score_fn<CodeFmt::F16>(nc);
    case CodeFmt::BF16: return score_fn<CodeFmt::BF16>(nc);
    case CodeFmt::I8: return score_fn<CodeFmt::I8>(nc);
    case CodeFmt::Q4: return score_fn<CodeFmt::Q4>(nc);
    case CodeFmt::F8: return score_fn<CodeFmt::F8>(nc);
  }
  return nullptr;
}
ValueFn pick_value(CodeFmt f, int nc) {
  switch (f) {
    case CodeFmt::F32: return value_fn<CodeFmt::F32>(nc);
    case CodeFmt::F16: return value_fn<CodeFmt::F16>(nc);
    case CodeFmt::BF16: return value_fn<CodeFmt::BF16>(nc);
    case CodeFmt::I8: return value_fn<CodeFmt::I8>(nc);
    case CodeFmt::Q4: return value_fn<CodeFmt::Q4>(nc);
    case CodeFmt::F8: return value_fn<CodeFmt::F8>(nc);
  }
  return nullptr;
}
int padded_cols(int nc) { return nc <= 1 ? 1 : nc <= 2 ? 2 : nc <= 4 ? 4 : nc <= 8 ? 8 : kMaxCols; }

// ---------------------------------------------------------------- driver

struct Geometry {
  int64_t B, Hq, Hkv, G, D, Dv, Dp, Dvp;
  int64_t nh, R, head_tiles, row_tiles, nsplit;  // column tiling: nh heads x R rows per tile
  int64_t page, table_stride;
  const int32_t* table;
  const int32_t* lens;
  const int32_t* cu_q;  // packed queries, or nullptr
  int64_t q_len;        // Nq (packed: max_seqlen_q)
  bool causal, window_left, softcap;
  int64_t right, left;
  float scale2, cap2, inv_cap2;
  const float* sinks2;  // base-2 sink logits per query head, or nullptr
  Side k, v;
  ScoreFn score;
  ValueFn value;
  int nc;  // padded columns per tile
};

struct Workspace {
  FloatBuffer qp, o, s, gk, gv;
  std::vector<const uint8_t*> krow, vrow;
  float m[kMaxCols], l[kMaxCols], ksc[kKeyBlock], vsc[kKeyBlock];
  Workspace(const Geometry& g) : krow(kKeyBlock), vrow(kKeyBlock) {
    qp.resize(kMaxCols * g.Dp);
    o.resize(kMaxCols * g.Dvp);
    s.resize(kMaxCols * kKeyBlock);
    gk.resize(2 * kKeyBlock * std::max<int64_t>(g.k.groups, 1));
    gv.resize(2 * kKeyBlock * std::max<int64_t>(g.v.groups, 1));
  }
};

// The group scales and biases of one key row into gsc / gbi[j * groups + g].
void load_groups(const Side& sd, int64_t blk, int64_t row, int64_t h, int64_t j, float* gsc, float* gbi) {
  const int64_t so = blk * sd.ss[0] + row * sd.ss[1] + h * sd.ss[2];
  const int64_t bo = blk * sd.bs[0] + row * sd.bs[1] + h * sd.bs[2];
  for (int64_t g = 0; g < sd.groups; ++g) {
    gsc[j * sd.groups + g] = read_float(sd.scale, sd.sdt, so + g * sd.ss[3]);
    gbi[j * sd.groups + g] = read_float(sd.bias, sd.sdt, bo + g * sd.bs[3]);
  }
}

template <typename T>
struct Call {
  const Geometry& g;
  const T* q;
  int64_t qs[4];
  T* out;
  int64_t os[4];
  float* lse;
  int64_t ls[3];
  float* partial;  // nsplit > 1: per unit, nc columns of (m, l, O[Dvp])

  // Query row i of sequence b, head h: its offset in q / out (packed queries: rows cu_q[b] + i of batch 0).
  int64_t bi(int64_t b) const { return g.cu_q ? 0 : b; }
  int64_t row0(int64_t b) const { return g.cu_q ? g.cu_q[b] : 0; }
  int64_t nq(int64_t b) const { return g.cu_q ? g.cu_q[b + 1] - g.cu_q[b] : g.q_len; }

  void run_unit(int64_t unit, Workspace& ws) const;
  void merge(int64_t tile) const;
};

template <typename T>
void Call<T>::run_unit(int64_t unit, Workspace& ws) const {
  const int64_t split = unit % g.nsplit;
  int64_t t = unit / g.nsplit;
  const int64_t rt = t % g.row_tiles;
  t /= g.row_tiles;
  const int64_t ht = t % g.head_tiles;
  t /= g.head_tiles;
  const int64_t hk = t % g.Hkv, b = t / g.Hkv;
  const int64_t nk = g.lens[b], nqb = nq(b);
  const int64_t h0 = hk * g.G + ht * g.nh, nh = std::min(g.nh, g.G - ht * g.nh), r0 = rt * g.R;
  const int nc = g.nc;
  int64_t head[kMaxCols], row[kMaxCols];
  bool live[kMaxCols];
  int64_t imin = std::numeric_limits<int64_t>::max(), imax = -1;
  for (int c = 0; c < nc; ++c) {
    head[c] = h0 + c / g.R;
    row[c] = r0 + c % g.R;
    live[c] = c < nh * g.R && row[c] < nqb;
    if (live[c]) {
      imin = std::min(imin, row[c]);
      imax = std::max(imax, row[c]);
    }
  }
  float* part = g.nsplit > 1 ? partial + unit * nc * (g.Dvp + 2) : nullptr;
  float* m = ws.m;
  float* l = ws.l;
  float* O = ws.o.ptr;
  std::fill(O, O + nc * g.Dvp, 0.0f);
  for (int c = 0; c < nc; ++c) {
    m[c] = kNegInf;
    l[c] = 0.0f;
  }
  const auto finish = [&] {
    if (part != nullptr) {
      for (int c = 0; c < nc; ++c) {
        float* pc = part + c * (g.Dvp + 2);
        pc[0] = m[c];
        pc[1] = l[c];
        std::copy(O + c * g.Dvp, O + c * g.Dvp + g.Dv, pc + 2);
      }
      return;
    }
    const float vdesc = g.v.fmt == CodeFmt::F8 ? g.v.fp8_descale(b, hk) / kFp8Unit : 1.0f;
    for (int c = 0; c < nc; ++c) {
      if (!live[c]) continue;
      const int64_t r = row0(b) + row[c];
      T* dst = out + bi(b) * os[0] + head[c] * os[1] + r * os[2];
      const float inv = l[c] > 0.0f ? vdesc / l[c] : 0.0f;
      for (int64_t d = 0; d < g.Dv; ++d) dst[d * os[3]] = static_cast<T>(O[c * g.Dvp + d] * inv);
      lse[bi(b) * ls[0] + head[c] * ls[1] + r * ls[2]] =
          l[c] > 0.0f ? (m[c] + std::log2(l[c])) * kLn2 : kNegInf;
    }
  };
  if (imax < 0) return finish();
  // Sinks: each row starts as if it had seen its head's sink (split 0 only).
  for (int c = 0; g.sinks2 != nullptr && split == 0 && c < nc; ++c) {
    if (!live[c]) continue;
    m[c] = g.sinks2[head[c]];
    l[c] = m[c] == kNegInf ? 0.0f : 1.0f;
  }
  // Keys any live column sees: [kb, ke), bottom-right aligned on this sequence.
  const int64_t upper = nk - nqb + g.right, lower = nk - nqb - g.left;
  int64_t kb = g.window_left ? std::min(nk, std::max<int64_t>(0, imin + lower)) : 0;
  int64_t ke = g.causal ? std::min(nk, std::max<int64_t>(0, imax + upper + 1)) : nk;
  ke = std::max(ke, kb);
  const int64_t span = (ke - kb + g.nsplit - 1) / g.nsplit;
  const int64_t chunk = (span + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const int64_t ks = std::min(ke, kb + split * chunk), kend = std::min(ke, ks + chunk);
  // q packed per column, scaled into base 2 (fp8 K: its descale folded in).
  const float kdesc = g.k.fmt == CodeFmt::F8 ? g.k.fp8_descale(b, hk) / kFp8Unit : 1.0f;
  float* qp = ws.qp.ptr;
  for (int c = 0; c < nc; ++c) {
    float* dst = qp + c * g.Dp;
    std::fill(dst, dst + g.Dp, 0.0f);
    if (!live[c]) continue;
    const T* src = q + bi(b) * qs[0] + head[c] * qs[1] + (row0(b) + row[c]) * qs[2];
    for (int64_t d = 0; d < g.D; ++d) dst[d] = static_cast<float>(src[d * qs[3]]) * g.scale2 * kdesc;
  }
  float* S = ws.s.ptr;
  float* kgs = ws.gk.ptr;
  float* kgb = kgs + kKeyBlock * std::max<int64_t>(g.k.groups, 1);
  float* vgs = ws.gv.ptr;
  float* vgb = vgs + kKeyBlock * std::max<int64_t>(g.v.groups, 1);
  const int32_t* table = g.table + b * g.table_stride;
  for (int64_t j0 = ks; j0 < kend; j0 += kKeyBlock) {
    const int nkb = static_cast<int>(std::min<int64_t>(kKeyBlock, kend - j0));
    for (int j = 0; j < nkb; ++j) {
      const int64_t key = j0 + j, blk = table[key / g.page], r = key % g.page;
      ws.krow[j] = g.k.base + blk * g.k.s_blk + r * g.k.s_row + hk * g.k.s_head;
      ws.vrow[j] = g.v.base + blk * g.v.s_blk + r * g.v.s_row + hk * g.v.s_head;
      if (g.k.fmt == CodeFmt::I8)
        ws.ksc[j] = static_cast<const float*>(g.k.scale)[blk * g.k.ss[0] + r * g.k.ss[1] + hk * g.k.ss[2]];
      if (g.v.fmt == CodeFmt::I8)
        ws.vsc[j] = static_cast<const float*>(g.v.scale)[blk * g.v.ss[0] + r * g.v.ss[1] + hk * g.v.ss[2]];
      if (g.k.fmt == CodeFmt::Q4) load_groups(g.k, blk, r, hk, j, kgs, kgb);
      if (g.v.fmt == CodeFmt::Q4) load_groups(g.v, blk, r, hk, j, vgs, vgb);
    }
    g.score(ws.krow.data(), nkb, qp, g.Dp, g.D, kgs, kgb, g.k.groups, g.k.gs, S);
    for (int c = 0; c < nc; ++c) {
      float* sc = S + c * kKeyBlock;
      if (!live[c]) {
        std::fill(sc, sc + kKeyBlock, 0.0f);  // weights of a dead column: zero
        continue;
      }
      if (g.k.fmt == CodeFmt::I8)
        for (int j = 0; j < nkb; ++j) sc[j] *= ws.ksc[j];
      if (g.softcap) {
        for (int j = 0; j < nkb; j += kW) {
          const Vec x = Vec::load(sc + j);
          (Vec::broadcast(g.cap2) * tanh_approx(x * Vec::broadcast(g.inv_cap2))).store(sc + j);
        }
      }
      for (int j = nkb; j < kKeyBlock; ++j) sc[j] = kNegInf;
      if (g.causal && j0 + nkb - 1 > row[c] + upper)
        for (int j = 0; j < nkb; ++j) sc[j] = j0 + j > row[c] + upper ? kNegInf : sc[j];
      if (g.window_left && j0 < row[c] + lower)
        for (int j = 0; j < nkb; ++j) sc[j] = j0 + j < row[c] + lower ? kNegInf : sc[j];
      Vec mx = Vec::broadcast(kNegInf);
      for (int j = 0; j < kKeyBlock; j += kW) mx = vmax(mx, Vec::load(sc + j));
      alignas(64) float lanes[kW];
      mx.store(lanes);
      float bm = kNegInf;
      for (int i = 0; i < kW; ++i) bm = std::max(bm, lanes[i]);
      const float mnew = std::max(m[c], bm);
      if (mnew == kNegInf) {  // nothing seen yet: the block's weights are zero
        std::fill(sc, sc + kKeyBlock, 0.0f);
        continue;
      }
      const float alpha = m[c] == kNegInf ? 0.0f : std::exp2(m[c] - mnew);
      Vec sum = Vec::zero();
      const Vec mv = Vec::broadcast(mnew);
      for (int j = 0; j < kKeyBlock; j += kW) {
        const Vec p = exp2_approx(Vec::load(sc + j) - mv);
        sum = sum + p;
        p.store(sc + j);
      }
      sum.store(lanes);
      float bs = 0.0f;
      for (int i = 0; i < kW; ++i) bs += lanes[i];
      l[c] = l[c] * alpha + bs;
      m[c] = mnew;
      if (alpha != 1.0f) {
        float* oc = O + c * g.Dvp;
        for (int64_t d = 0; d < g.Dvp; ++d) oc[d] *= alpha;
      }
      if (g.v.fmt == CodeFmt::I8)
        for (int j = 0; j < nkb; ++j) sc[j] *= ws.vsc[j];
    }
    g.value(ws.vrow.data(), nkb, S, g.Dv, vgs, vgb, g.v.groups, g.v.gs, O, g.Dvp);
  }
  finish();
}

// The splits of one tile merged through their log-sum-exp, into out and lse.
template <typename T>
void Call<T>::merge(int64_t tile) const {
  int64_t t = tile / g.row_tiles / g.head_tiles;
  const int64_t rt = tile % g.row_tiles, ht = (tile / g.row_tiles) % g.head_tiles;
  const int64_t hk = t % g.Hkv, b = t / g.Hkv;
  const int64_t nqb = nq(b), h0 = hk * g.G + ht * g.nh, nh = std::min(g.nh, g.G - ht * g.nh), r0 = rt * g.R;
  const float vdesc = g.v.fmt == CodeFmt::F8 ? g.v.fp8_descale(b, hk) / kFp8Unit : 1.0f;
  const int64_t stride = g.nc * (g.Dvp + 2);
  for (int c = 0; c < nh * g.R; ++c) {
    const int64_t h = h0 + c / g.R, i = r0 + c % g.R;
    if (i >= nqb) continue;
    const float* first = partial + tile * g.nsplit * stride + c * (g.Dvp + 2);
    float mx = kNegInf;
    for (int64_t s = 0; s < g.nsplit; ++s) mx = std::max(mx, first[s * stride]);
    double l = 0.0;
    std::vector<double> acc(g.Dv, 0.0);
    for (int64_t s = 0; s < g.nsplit && mx != kNegInf; ++s) {
      const float* p = first + s * stride;
      if (p[0] == kNegInf) continue;
      const double w = std::exp2(static_cast<double>(p[0]) - mx);
      l += w * p[1];
      for (int64_t d = 0; d < g.Dv; ++d) acc[d] += w * p[2 + d];
    }
    const int64_t r = row0(b) + i;
    T* dst = out + bi(b) * os[0] + h * os[1] + r * os[2];
    for (int64_t d = 0; d < g.Dv; ++d) dst[d * os[3]] = static_cast<T>(l > 0 ? acc[d] / l * vdesc : 0.0);
    lse[bi(b) * ls[0] + h * ls[1] + r * ls[2]] =
        l > 0 ? static_cast<float>((mx + std::log2(l)) * kLn2) : kNegInf;
  }
}

int64_t env_splits() {
  const char* s = std::getenv("FLASH_METAL_KVQ_SPLITS");
  if (s == nullptr || *s == '\0') return 0;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  TORCH_CHECK_VALUE(end != nullptr && *end == '\0' && v >= 1 && v <= 256, "FLASH_METAL_KVQ_SPLITS='", s,
                    "' must be an integer from 1 to 256 (key splits per tile; unset: chosen per call)");
  return v;
}

}  // namespace

void kvcache_quant_forward(const KvCacheCall& kc, const KvQuant& kq, const AttentionOutputs& o) {
  const AttentionProblem& p = kc.c.p;
  Geometry g{};
  g.B = p.batch;
  g.Hq = p.q_heads;
  g.Hkv = p.kv_heads;
  g.G = p.q_heads / p.kv_heads;
  g.D = p.head_dim;
  g.Dv = p.head_dim_v;
  g.Dp = round_up(g.D, kQW);
  g.Dvp = round_up(g.Dv, kQW);
  g.page = p.page_size;
  g.table_stride = p.table_stride;
  g.table = kc.block_table.const_data_ptr<int32_t>();
  g.lens = kc.cache_seqlens.const_data_ptr<int32_t>();
  g.cu_q = p.varlen ? kc.cu_seqlens_q.const_data_ptr<int32_t>() : nullptr;
  g.q_len = p.q_len;
  g.causal = p.causal;
  g.window_left = p.has_window_left();
  g.right = p.window_right > 0 ? p.window_right : 0;
  g.left = p.window_left;
  g.scale2 = p.scale_log2();
  g.softcap = p.has_softcap();
  if (g.softcap) {
    g.cap2 = static_cast<float>(p.softcap * 1.4426950408889634);
    g.inv_cap2 = 1.0f / g.cap2;
  }
  std::vector<float> sinks2;
  if (p.sinks) {
    sinks2 = sinks_base2(kc.c);
    g.sinks2 = sinks2.data();
  }
  g.k = make_side(kq.k);
  g.v = make_side(kq.v);
  // Column tiles: the whole GQA group times R rows, or kMaxCols heads of a wider group.
  if (g.G >= kMaxCols) {
    g.nh = kMaxCols;
    g.R = 1;
  } else {
    g.nh = g.G;
    g.R = std::max<int64_t>(1, std::min<int64_t>(kMaxCols / g.G, g.q_len));
  }
  g.head_tiles = (g.G + g.nh - 1) / g.nh;
  g.row_tiles = (g.q_len + g.R - 1) / g.R;
  g.nc = padded_cols(static_cast<int>(std::min<int64_t>(g.G, g.nh) * g.R));
  g.score = pick_score(g.k.fmt, g.nc);
  g.value = pick_value(g.v.fmt, g.nc);
  const int64_t tiles = g.B * g.Hkv * g.head_tiles * g.row_tiles;
  const int64_t threads = std::max(1, at::get_num_threads());
  // Split the keys when the tiles alone would leave threads idle: aim for 4
  // units per thread, each split at least 512 keys (below that the merge and
  // the per-split setup outweigh the parallelism).
  int64_t max_len = 0;
  for (int64_t b = 0; b < g.B; ++b) max_len = std::max<int64_t>(max_len, g.lens[b]);
  g.nsplit = env_splits();
  if (g.nsplit == 0) {
    g.nsplit = 1;
    if (tiles < 4 * threads) g.nsplit = std::clamp<int64_t>(std::min((4 * threads + tiles - 1) / tiles,
                                                                     max_len / 512), 1, 64);
  }
  g_counts[static_cast<int>(g.k.fmt)].fetch_add(1);
  g_counts[kNumCodeFmts + static_cast<int>(g.v.fmt)].fetch_add(1);
  if (g.nsplit > 1) g_counts[2 * kNumCodeFmts].fetch_add(1);
  const int64_t units = tiles * g.nsplit;
  g_counts[2 * kNumCodeFmts + 1].fetch_add(units);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.dtype, "kvcache_quant_forward", [&] {
    using T = scalar_t;
    std::vector<float> partial(g.nsplit > 1 ? units * g.nc * (g.Dvp + 2) : 0);
    Call<T> call{g, kc.c.q.const_data_ptr<T>(), {}, o.out4.mutable_data_ptr<T>(), {}, o.lse3.mutable_data_ptr<float>(),
                 {}, partial.data()};
    for (int d = 0; d < 4; ++d) {
      call.qs[d] = kc.c.q.stride(d);
      call.os[d] = o.out4.stride(d);
    }
    for (int d = 0; d < 3; ++d) call.ls[d] = o.lse3.stride(d);
    const auto fan = [&](int64_t n, const auto& body) {
      std::atomic<int64_t> next{0};
      run_on_threads(std::min(threads, n), [&](int64_t) {
        std::unique_ptr<Workspace> ws;
        for (int64_t u = next.fetch_add(1); u < n; u = next.fetch_add(1)) body(u, ws);
      });
    };
    fan(units, [&](int64_t u, std::unique_ptr<Workspace>& ws) {
      if (!ws) ws = std::make_unique<Workspace>(g);
      call.run_unit(u, *ws);
    });
    if (g.nsplit > 1) fan(tiles, [&](int64_t t, std::unique_ptr<Workspace>&) { call.merge(t); });
  });
}

std::vector<int64_t> kvcache_quant_counts() {
  std::vector<int64_t> r;
  for (auto& c : g_counts) r.push_back(c.load());
  return r;
}

}  // namespace cpu
}  // namespace flash_metal
