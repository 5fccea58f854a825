// Pieces shared by the CPU forward (attention_cpu.cpp) and backward
// (attention_backward_cpu.cpp) kernels: an aligned float buffer, the
// row conversion to float32 used by every packing routine, and the thread
// fan-out. Moved here unchanged from attention_cpu.cpp.
#pragma once

#include "simd.h"
#include "../checks.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <condition_variable>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <functional>
#include <memory>
#include <mutex>

namespace flash_metal {
namespace cpu {

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// 64-byte aligned float buffer (one cache line; no split vector loads).
struct FloatBuffer {
  std::unique_ptr<float[]> raw;
  float* ptr = nullptr;
  void resize(int64_t n) {
    raw.reset(new float[n + 16]);
    auto addr = reinterpret_cast<uintptr_t>(raw.get());
    ptr = reinterpret_cast<float*>((addr + 63) & ~uintptr_t(63));
  }
};

// A 64-byte aligned array of trivially copyable elements, for the matrix
// units' operands (the subset of std::vector the kernels use: construct or
// resize with zeros, data(), size()). Why aligned: an AMX tile load whose rows
// straddle cache lines runs at about half speed. Measured on the AMX Xeon
// (issue 39, one thread, ATen's brgemm, 128 x 96 x 128 in bfloat16): 220
// flop/tick with std::vector's 16-byte aligned operands, 550-600 with 64.
template <typename T>
class AlignedVec {
 public:
  AlignedVec() = default;
  explicit AlignedVec(int64_t n) { resize(n); }
  // zero: fill with zeros (as std::vector would); false for a buffer the caller writes whole
  void resize(int64_t n, bool zero = true) {
    static_assert(std::is_trivially_copyable<T>::value, "AlignedVec holds plain elements");
    const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
    mem_.reset(n > 0 ? static_cast<T*>(::operator new(bytes, std::align_val_t(64))) : nullptr);
    if (n > 0 && zero) std::fill(mem_.get(), mem_.get() + n, T(0.0f));
    n_ = n;
  }
  T* data() { return mem_.get(); }
  const T* data() const { return mem_.get(); }
  int64_t size() const { return n_; }
  T& operator[](int64_t i) { return mem_.get()[i]; }

 private:
  struct Free {
    void operator()(T* p) const { ::operator delete(p, std::align_val_t(64)); }
  };
  std::unique_ptr<T, Free> mem_;
  int64_t n_ = 0;
};

// dst[0..n) = float(src[0..n) with element stride `stride`)
template <typename T>
inline void convert_row(const T* src, int64_t stride, int64_t n, float* dst) {
  int64_t d = 0;
  if (stride == 1) {
    for (; d + kW <= n; d += kW) load_convert(src + d).store(dst + d);
  }
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d * stride]);
}

// Runs body(t) for t in [0, threads) concurrently, on torch's intra-op
// threads. at::parallel_for's OpenMP backend is an inline `#pragma omp
// parallel` in ATen's headers, so it only runs in parallel when this file is
// compiled with -fopenmp (measured: without it, 2 "threads" ran exactly as
// fast as 1). Without OpenMP (a build without the flag, Apple clang) we fan
// out on ATen's inter-op pool instead, which lives inside libtorch.
template <typename F>
inline void run_on_threads(int64_t threads, const F& body) {
#if defined(_OPENMP)
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) body(t);
  });
#else
  if (threads <= 1 || at::in_parallel_region()) {
    body(0);
    return;
  }
  // Every body pulls work from a shared counter until it runs dry, so the
  // caller alone can finish everything; a pool task that starts only after
  // the caller is done returns without touching the work (no deadlock when
  // the pool is busy, no dangling references).
  struct Fanout {
    std::mutex mu;
    std::condition_variable cv;
    int64_t active = 0;
    bool closed = false;
  };
  auto state = std::make_shared<Fanout>();
  auto fn = std::make_shared<std::function<void(int64_t)>>([&body](int64_t t) { body(t); });
  for (int64_t t = 1; t < threads; ++t) {
    at::launch([state, fn, t] {
      {
        std::lock_guard<std::mutex> lock(state->mu);
        if (state->closed) return;
        ++state->active;
      }
      (*fn)(t);
      std::lock_guard<std::mutex> lock(state->mu);
      if (--state->active == 0) state->cv.notify_all();
    });
  }
  body(0);
  std::unique_lock<std::mutex> lock(state->mu);
  state->closed = true;
  state->cv.wait(lock, [&] { return state->active == 0; });
#endif
}


// ---------------------------------------------------------------- issue 11 options
// Base-2 score at or below which a key counts as masked: -2^100 (the
// natural-log rule -2^100 * ln 2 of flash_metal/reference.py MASKED_SCORE,
// in the kernels' base-2 units), so -inf and float32's finfo.min drop a key.
constexpr float kMaskedScore2 = -1.2676506002282294e30f;  // -2^100
constexpr float kLog2eF = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;  // lse = ln 2 (m + log2 l): base-2 state to natural log
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One sequence of a call: which batch index its rows use (varlen: 0, the
// packed tensors' only batch), its first q and k rows (varlen: the
// cu_seqlens offsets; else 0), its lengths, and its key bounds: query i
// sees keys j <= i + upper (when bounded above) and j >= i + lower (when
// bounded below), bottom-right aligned on the sequence's own lengths.
struct SeqRange {
  int64_t bi, q0, k0, nq, nk, upper, lower;
};

// Everything per call that the option code needs, read from the validated call.
struct CallOptions {
  bool varlen = false, causal = false, window_left = false;
  const int32_t *cu_q = nullptr, *cu_k = nullptr;
  int64_t q_len = 0, kv_len = 0, right = 0, left = 0;
  int64_t rows_q = 0, rows_k = 0;  // rows of a head in the packed outputs (varlen: total_q / total_k)
  // softcap (base-2 units: cap2 = softcap * log2 e, so cap2 * tanh(s2 / cap2)
  // is softcap * tanh(s / softcap) with s2 = s * log2 e)
  bool softcap = false;
  float cap2 = 0.0f, inv_cap2 = 0.0f;
  MaskKind mask = MaskKind::None;
  const void* mask_ptr = nullptr;
  int64_t ms[4] = {0, 0, 0, 0};  // the (B, Hq, Nq, Nk) view's strides, in elements
  bool score_options() const { return softcap || mask != MaskKind::None; }

  explicit CallOptions(const AttentionCall& c) {
    const AttentionProblem& p = c.p;
    varlen = p.varlen;
    causal = p.causal;
    window_left = p.has_window_left();
    q_len = p.q_len;
    kv_len = p.kv_len;
    right = p.window_right > 0 ? p.window_right : 0;
    left = p.window_left;
    rows_q = varlen ? p.total_q : p.q_len;
    rows_k = varlen ? p.total_k : p.kv_len;
    if (varlen) {
      cu_q = c.cu_seqlens_q.const_data_ptr<int32_t>();
      cu_k = c.cu_seqlens_k.const_data_ptr<int32_t>();
    }
    softcap = p.has_softcap();
    if (softcap) {
      cap2 = static_cast<float>(p.softcap * 1.4426950408889634);
      inv_cap2 = 1.0f / cap2;
    }
    mask = p.mask;
    if (mask != MaskKind::None) {
      mask_ptr = c.mask.const_data_ptr();
      for (int d = 0; d < 4; ++d) ms[d] = c.mask.stride(d);
    }
  }

  SeqRange seq(int64_t b) const {
    SeqRange s;
    if (varlen) {
      s.bi = 0;
      s.q0 = cu_q[b];
      s.k0 = cu_k[b];
      s.nq = cu_q[b + 1] - s.q0;
      s.nk = cu_k[b + 1] - s.k0;
    } else {
      s.bi = b;
      s.q0 = s.k0 = 0;
      s.nq = q_len;
      s.nk = kv_len;
    }
    s.upper = s.nk - s.nq + right;
    s.lower = s.nk - s.nq - left;
    return s;
  }
  // Keys [key_begin, key_end) hold every key visible to query rows [i0, i1) of s.
  int64_t key_begin(const SeqRange& s, int64_t i0) const {
    return window_left ? std::min(s.nk, std::max<int64_t>(0, i0 + s.lower)) : 0;
  }
  int64_t key_end(const SeqRange& s, int64_t i1) const {
    return causal ? std::min(s.nk, std::max<int64_t>(0, i1 + s.upper)) : s.nk;
  }
};

// Softcap, then the mask, on a transposed block of base-2 scores: st[j * ld + c]
// is key j0 + j of column c. Softcap covers columns [0, ncols) (padding
// columns included, so dfac is defined everywhere); the mask only the live
// columns [0, nlive), column c reading the mask at moff[c] + key * ms[3].
// dfac (optional, the backward): 1 - tanh^2, the softcap's derivative.
// The softcap's tanh is simd.h's tanh_approx (vectorized; within a few ulps).
template <typename MT>
inline void apply_mask_block(const CallOptions& o, float* st, int64_t ld, int64_t nk, int64_t nlive,
                             const int64_t* moff, int64_t j0) {
  const MT* m = static_cast<const MT*>(o.mask_ptr);
  const int64_t s3 = o.ms[3];
  for (int64_t j = 0; j < nk; ++j) {
    float* row = st + j * ld;
    const int64_t key = (j0 + j) * s3;
    for (int64_t c = 0; c < nlive; ++c) {
      float s;
      if (std::is_same<MT, bool>::value) {
        s = reinterpret_cast<const uint8_t*>(m)[moff[c] + key] ? row[c] : -std::numeric_limits<float>::infinity();
      } else {
        s = row[c] + static_cast<float>(m[moff[c] + key]) * kLog2eF;
        if (s <= kMaskedScore2) s = -std::numeric_limits<float>::infinity();
      }
      row[c] = s;
    }
  }
}

template <typename T>
inline void apply_score_options(const CallOptions& o, float* st, int64_t ld, int64_t nk, int64_t ncols, int64_t nlive,
                                const int64_t* moff, int64_t j0, float* dfac) {
  if (o.softcap) {  // ncols is a multiple of the vector width (kernels pad score blocks to kMW)
    const Vec cap = Vec::broadcast(o.cap2), inv = Vec::broadcast(o.inv_cap2), one = Vec::broadcast(1.0f);
    for (int64_t j = 0; j < nk; ++j) {
      float* row = st + j * ld;
      float* drow = dfac ? dfac + j * ld : nullptr;
      for (int64_t c = 0; c < ncols; c += kW) {
        const Vec t = tanh_approx(Vec::load(row + c) * inv);
        (cap * t).store(row + c);
        if (drow) (one - t * t).store(drow + c);
      }
    }
  }
  switch (o.mask) {
    case MaskKind::Bool: apply_mask_block<bool>(o, st, ld, nk, nlive, moff, j0); break;
    case MaskKind::Input: apply_mask_block<T>(o, st, ld, nk, nlive, moff, j0); break;
    case MaskKind::Float32: apply_mask_block<float>(o, st, ld, nk, nlive, moff, j0); break;
    case MaskKind::None: break;
  }
}

// Sets st[j][c] = -inf for the columns of query rows [i0, i0 + nq) (nh heads
// side by side, nq columns each) that the causal/right bound or the left
// window hides from key j0 + j; only called on blocks straddling a bound.
inline void mask_window_block(const CallOptions& o, const SeqRange& s, float* st, int64_t ld, int64_t nk, int64_t j0,
                              int64_t i0, int64_t nq, int64_t nh) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const bool up = o.causal && j0 + nk - 1 > i0 + s.upper;
  const bool low = o.window_left && j0 < i0 + nq - 1 + s.lower;
  if (!up && !low) return;
  for (int64_t j = 0; j < nk; ++j) {
    float* row = st + j * ld;
    // key j0 + j is visible to row i iff j0 + j - upper <= i <= j0 + j - lower
    const int64_t first = up ? std::min(nq, std::max<int64_t>(0, j0 + j - s.upper - i0)) : 0;
    const int64_t last = low ? std::min(nq, std::max<int64_t>(0, j0 + j - s.lower - i0 + 1)) : nq;
    for (int64_t h = 0; h < nh; ++h) {
      float* r = row + h * nq;
      std::fill(r, r + first, ninf);
      if (last < nq) std::fill(r + std::max(first, last), r + nq, ninf);
    }
  }
}

}  // namespace cpu
}  // namespace flash_metal
