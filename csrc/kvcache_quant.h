// Quantized KV caches for attention_kvcache (issue 44): the formats, their
// layouts and the validation every backend shares. The kernels read the
// codes and scales directly and dequantize in registers (CPU:
// csrc/cpu/kvcache_quant_cpu.cpp); nothing here converts a cache.
//
// Formats (each side, K or V, has its own; llama.cpp's -ctk / -ctv):
//   Native  the cache in q's dtype, as before (no scale, no bias).
//   Int8    int8 codes, symmetric, one scale per (token, kv head): value =
//           code * scale. scale: float32 (num_blocks, page_size, Hkv) (a plain
//           cache: (B_cache, seqlen, Hkv)), any strides.
//   Q4      4-bit group-wise affine in MLX's layout (mx.quantize, bits=4):
//           along D, groups of group_size (32, 64 or 128) consecutive
//           elements; element d's code is the 4-bit field at bits
//           4 * (d % 8) of little-endian uint32 word d / 8 (lowest bits
//           first), so the cache is uint32 (..., D / 8) or, the same bytes,
//           uint8 (..., D / 2) with element 2i in byte i's low nibble and
//           2i + 1 in its high nibble. value = code * scale[g] + bias[g],
//           g = d / group_size; scale and bias (..., Hkv, D / group_size) in
//           float32, float16 or bfloat16 (MLX stores them in the weights'
//           dtype). The group size is inferred: D / scale.size(-1).
//   Fp8     torch.float8_e4m3fn codes with a float32 descale per (batch,
//           kv head) (flash-attn 3's k_descale / v_descale, shape (B, Hkv))
//           or per tensor (one element): value = float(code) * descale.
// The cache's last dim must be contiguous (stride 1); other dims any stride.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace flash_metal {

enum class KvFormat : uint8_t { Native = 0, Int8 = 1, Q4 = 2, Fp8 = 3 };

const char* kv_format_name(KvFormat f);

// One side (K or V) of a quantized call, validated.
struct KvSide {
  KvFormat format = KvFormat::Native;
  at::Tensor codes;   // the cache as given (last dim contiguous)
  at::Tensor scale;   // Int8: (blocks, page, Hkv) float32; Q4: (blocks, page, Hkv, G); Fp8: (B, Hkv) or 1 element
  at::Tensor bias;    // Q4 only: as scale
  int64_t head_dim = 0;    // D, the logical (dequantized) head dim
  int64_t group_size = 0;  // Q4 only
  int64_t groups = 0;      // Q4 only: D / group_size
  bool per_tensor = false; // Fp8 only: one descale for the whole tensor
};

struct KvQuant {
  KvSide k, v;
  bool quantized() const { return k.format != KvFormat::Native || v.format != KvFormat::Native; }
};

// Parses k_format / v_format ("auto": from the cache's dtype; or "native",
// "int8", "q4", "fp8_e4m3", which must agree with it) and validates each
// side's scales against its cache. batch = the number of sequences (fp8's
// descale rows). Each bad argument gets an error naming it.
KvQuant check_kv_quant(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& k_bias,
                       const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& v_bias,
                       const std::string& k_format, const std::string& v_format, int64_t batch);

struct AttentionProblem;

// The problem's quantized-cache fields (AttentionProblem::k_format, ...) from a validated call.
void describe_kv_quant(const KvQuant& kq, AttentionProblem* p);

// The Metal kernels read a 4-bit side's scale and bias through one set of
// strides with the group index contiguous: where they differ (or it is
// not), both are made contiguous (a copy of the scales only; none in the
// usual layouts). Int8 and fp8 scales are read at any strides.
void scales_for_metal(KvQuant* kq);

// A side's scale strides as the Metal kernels read them (KvQuantParams,
// shaders/common/params.h): (page or sequence, token, kv head), in elements
// of the scale's dtype; fp8 (sequence, 0, kv head), or zeros per tensor.
std::array<int64_t, 3> kv_scale_strides(const KvSide& s);

}  // namespace flash_metal
