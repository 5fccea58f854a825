// The CPU kernels, called by csrc/cpu/ops.cpp through the ops' common flow
// (csrc/attention_ops.h) on a validated, non-empty call.
#pragma once

#include "../attention_ops.h"

#include <vector>

namespace flash_metal {
namespace cpu {

// attention_forward / attention_varlen_forward (attention_cpu.cpp): writes
// o.out4 and o.lse3.
void attention_forward(const AttentionCall& c, const AttentionOutputs& o);

// attention_backward / attention_varlen_backward (attention_backward_cpu.cpp):
// writes the packed grads.grad_q4, grad_k4, grad_v4.
void attention_backward(const AttentionCall& c, const BackwardTensors& t, const AttentionGradients& grads);

// Attention sinks (sinks_cpu.cpp). The call's sinks as float32 base-2
// logits (sink * log2 e, the kernels' score units), one per query head.
std::vector<float> sinks_base2(const AttentionCall& c);
// grad_sinks (Hq,) of a call with sinks: for each query head, the sum over
// its rows of exp(sink - lse) * (grad_lse - rowsum(grad_out * out)).
void sinks_backward(const AttentionCall& c, const BackwardTensors& t, const at::Tensor& grad_sinks);

}  // namespace cpu
}  // namespace flash_metal
