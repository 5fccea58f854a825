// The composite path: attention as chunked ATen operations (matmul, softmax
// by hand, matmul), on whatever device the tensors live on. It is the
// unfused plan of issue 20, section 3: where no fused Metal kernel exists
// that the performance model puts ahead of unfused (head dims above 256 but
// causal D = 512 forwards and wide decode: benchmarks/model/families/d512.py),
// the MPS op runs this instead of
// refusing, and explain() says why. Not a flash path: its memory is O(chunk x Nk) per (batch, head),
// bounded by kCompositeChunkBytes, never O(Nq x Nk).
//
// The same code runs on CPU tensors with impl="composite", which is how the
// test suite checks it (against the float64 oracle) without a Mac.
#pragma once

#include "attention_ops.h"
#include "checks.h"
#include "metal/plan.h"

#include <string>

namespace flash_metal {

// Float32 scores one chunk may hold, all (batch, head) pairs together. Why
// 64 MiB: the backward keeps four such temporaries (S, P, dP, dS) alive, so
// a chunk stays near 256 MiB of scratch whatever N is, while the chunks'
// matmuls stay large enough (at N = 8192 and 32 heads: 64 query rows) to
// run near the GPU's GEMM rate.
constexpr int64_t kCompositeChunkBytes = int64_t{64} << 20;

// Whether this call runs the composite path on Metal, and why (appended to
// *why). True for impl="composite"; for impl="auto": head dims above the
// widest fused bucket (the model's verdict), forward and backward, but the
// calls the wide decode (decode_takes_wide_dims) or the split-D kernels
// (splitd_takes: causal D = 512 forwards; impl='prefill' at 512, forward or
// backward) take. D_qk != D_v within it runs the fused
// kernels (issue 20 section 2).
bool composite_route(const AttentionProblem& p, KernelRequest requested, MetalPass pass, std::string* why);

// attention_forward / attention_varlen_forward: fills o.out4 and o.lse3.
void composite_forward(const AttentionCall& c, const AttentionOutputs& o);

// attention_backward / attention_varlen_backward: fills g's gradients
// (grad_sinks too when the call has sinks).
void composite_backward(const AttentionCall& c, const BackwardTensors& t, const AttentionGradients& g);

}  // namespace flash_metal
