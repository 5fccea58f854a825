// Pieces shared by the CPU forward (attention_cpu.cpp) and backward
// (attention_backward_cpu.cpp) kernels: an aligned float buffer, the
// row conversion to float32 used by every packing routine, and the thread
// fan-out. Moved here unchanged from attention_cpu.cpp.
#pragma once

#include "simd.h"

#include <ATen/Parallel.h>

#include <condition_variable>
#include <cstdint>
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

}  // namespace cpu
}  // namespace flash_metal
