#include <metal_stdlib>
using namespace metal;
// A static data member outside the constant address space: Apple's compiler
// rejects it (every variable with static storage must be `constant`).
template <int N>
struct Shape {
  static constexpr int kHalf = N / 2;
};
[[kernel]] void bad(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  out[lid] = float(Shape<8>::kHalf);
}
