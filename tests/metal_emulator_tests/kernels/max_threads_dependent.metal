#include <metal_stdlib>
using namespace metal;
// N depends on a template parameter: the emulator reads N from the template,
// where it has no value, so it refuses the kernel instead of dropping the limit.
template <int THREADS>
[[kernel]] [[max_total_threads_per_threadgroup(THREADS)]] void dependent(device float* out [[buffer(0)]],
                                                                         uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = float(tid);
}
template [[host_name("dependent_64")]] [[kernel]] decltype(dependent<64>) dependent<64>;
