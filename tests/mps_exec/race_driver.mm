// A test driver (never shipped): several threads ask library.mm's pipeline
// cache for the same, not yet built, pipeline at the same moment, which is
// what concurrent attention calls on a cold cache, or get_pipelines given the
// same request twice, do. Called through ctypes (which releases the GIL).
#include "fake_runtime.h"
#include "library.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

// `threads` threads, released together, each calling get_pipeline (or, with
// nothrow, try_get_pipeline) for kernel `kernel` with constants `bits`
// ("0"/"1" each). Returns {"states": [pipeline address per thread],
// "errors": [message per thread, "" if none]} as JSON.
extern "C" __attribute__((visibility("default"))) const char* fm_exec_race_get_pipeline(const char* kernel,
                                                                                      const char* bits, int threads,
                                                                                      int nothrow) {
  static thread_local std::string out;
  std::vector<bool> constants;
  for (const char* c = bits; *c != '\0'; ++c) constants.push_back(*c == '1');
  const size_t n = threads > 0 ? static_cast<size_t>(threads) : 1;
  std::vector<uintptr_t> states(n, 0);
  std::vector<std::string> errors(n);
  std::atomic<size_t> arrived{0};
  auto run = [&](size_t t) {
    ++arrived;
    while (arrived.load() < n) std::this_thread::yield();  // all start together: every one misses the cache
    try {
      flash_metal::mps::Pipeline p;
      if (nothrow != 0) {
        flash_metal::mps::PipelineResult r = flash_metal::mps::try_get_pipeline(fm_exec::device(), kernel, constants);
        p = r.pipeline;
        errors[t] = r.error;
      } else {
        p = flash_metal::mps::get_pipeline(fm_exec::device(), kernel, constants);
      }
      states[t] = reinterpret_cast<uintptr_t>(p.state);
    } catch (const std::exception& e) {
      errors[t] = e.what();
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 0; t < n; ++t) pool.emplace_back(run, t);
  for (std::thread& t : pool) t.join();
  out = "{\"states\":[";
  for (size_t t = 0; t < n; ++t) out += (t ? "," : "") + std::to_string(states[t]);
  out += "],\"errors\":[";
  for (size_t t = 0; t < n; ++t) out += (t ? "," : "") + fm_exec::quote(errors[t]);
  return (out += "]}").c_str();
}
