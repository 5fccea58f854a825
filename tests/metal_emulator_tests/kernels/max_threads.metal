#include <metal_stdlib>
using namespace metal;
// Kernels that declare [[max_total_threads_per_threadgroup(N)]]: a Metal
// pipeline admits at most N threads per threadgroup, so the emulator refuses
// a bigger dispatch. N as a literal, and as a program-scope constant on a
// template instantiated by host name (the form the attention shaders use).
[[kernel]] [[max_total_threads_per_threadgroup(64)]] void capped(device float* out [[buffer(0)]],
                                                                 uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = float(tid);
}

constant constexpr int kCap = 96;

template <typename T>
[[kernel]] [[max_total_threads_per_threadgroup(kCap)]] void capped_template(
    device T* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = T(tid);
}
template [[host_name("capped_float")]] [[kernel]] decltype(capped_template<float>) capped_template<float>;

// No attribute: only Metal's own limit, 1,024 threads.
[[kernel]] void uncapped(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = float(tid);
}
