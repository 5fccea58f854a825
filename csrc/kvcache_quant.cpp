// Quantized KV caches: format parsing and validation (see kvcache_quant.h).
#include "kvcache_quant.h"

#include "checks.h"

#include <c10/util/Exception.h>

namespace flash_metal {

const char* kv_format_name(KvFormat f) {
  switch (f) {
    case KvFormat::Native: return "native";
    case KvFormat::Int8: return "int8";
    case KvFormat::Q4: return "q4";
    case KvFormat::Fp8: return "fp8_e4m3";
  }
  return "?";
}

namespace {

constexpr const char* kFormats = "'auto', 'native', 'int8', 'q4' or 'fp8_e4m3'";

// The format the cache's dtype implies (Native: the cache in q's dtype).
KvFormat format_of_dtype(const char* op, const char* cache, const at::Tensor& t, const at::Tensor& q) {
  switch (t.scalar_type()) {
    case at::kChar: return KvFormat::Int8;
    case at::kInt:  // uint32 words are given to torch as uint32; int32 is refused below
    case at::kUInt32:
    case at::kByte: return KvFormat::Q4;
    case at::kFloat8_e4m3fn: return KvFormat::Fp8;
    default: break;
  }
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), op, ": ", cache, " has dtype ", t.scalar_type(),
                   " but q has dtype ", q.scalar_type(), "; a cache is either in q's dtype or quantized: int8 "
                   "(with a per-token scale), uint32 / uint8 (4-bit, MLX's packing, with scale and bias) or "
                   "float8_e4m3fn (with a descale)");
  return KvFormat::Native;
}

KvFormat parse_format(const char* op, const char* arg, const std::string& s) {
  if (s == "native") return KvFormat::Native;
  if (s == "int8") return KvFormat::Int8;
  if (s == "q4") return KvFormat::Q4;
  if (s == "fp8_e4m3") return KvFormat::Fp8;
  TORCH_CHECK_VALUE(false, op, ": ", arg, "='", s, "' is not a KV cache format; use ", kFormats);
  return KvFormat::Native;
}

void check_float_tensor(const char* op, const std::string& name, const at::Tensor& t, const at::Tensor& q,
                        bool half_ok) {
  const auto st = t.scalar_type();
  const bool ok = st == at::kFloat || (half_ok && (st == at::kHalf || st == at::kBFloat16));
  TORCH_CHECK_TYPE(ok, op, ": ", name, " must be ", half_ok ? "float32, float16 or bfloat16" : "float32",
                   "; got ", st);
  TORCH_CHECK_VALUE(t.device() == q.device(), op, ": ", name, " is on device ", t.device(), " but q is on device ",
                    q.device());
}

KvSide check_side(const char* op, const char* side, const at::Tensor& q, const at::Tensor& cache,
                  const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& bias,
                  const std::string& format, int64_t batch) {
  const std::string s(side);  // "k" or "v"
  const std::string cache_name = s + "_cache", scale_name = s + "_scale", bias_name = s + "_bias";
  const std::string fmt_name = s + "_format";
  TORCH_CHECK_VALUE(cache.defined(), op, ": ", cache_name, " is undefined (None)");
  const KvFormat implied = format_of_dtype(op, cache_name.c_str(), cache, q);
  KvSide r;
  r.format = format == "auto" ? implied : parse_format(op, fmt_name.c_str(), format);
  TORCH_CHECK_VALUE(r.format == implied, op, ": ", fmt_name, "='", format, "' does not match ", cache_name,
                    "'s dtype ", cache.scalar_type(), ", which holds the '", kv_format_name(implied), "' format");
  const bool has_scale = scale.has_value() && scale->defined();
  const bool has_bias = bias.has_value() && bias->defined();
  r.codes = cache;
  if (r.format == KvFormat::Native) {
    TORCH_CHECK_VALUE(!has_scale && !has_bias, op, ": ", has_scale ? scale_name : bias_name, " was given but ",
                      cache_name, " is not quantized (dtype ", cache.scalar_type(), ", q's); scales and biases go "
                      "with an int8, 4-bit or float8_e4m3fn cache");
    return r;
  }
  TORCH_CHECK_VALUE(cache.scalar_type() != at::kInt, op, ": ", cache_name, " is int32; a 4-bit cache is uint32 "
                    "(MLX's packing) or uint8");
  TORCH_CHECK_VALUE(cache.dim() == 4, op, ": ", cache_name, " must be 4-D (num_blocks or batch, page_size or "
                    "seqlen, kv_heads, packed head_dim); got shape ", cache.sizes());
  TORCH_CHECK_VALUE(cache.device() == q.device(), op, ": ", cache_name, " is on device ", cache.device(),
                    " but q is on device ", q.device());
  TORCH_CHECK_VALUE(cache.size(3) <= 1 || cache.stride(3) == 1, op, ": ", cache_name,
                    "'s last dim must be contiguous (stride 1); got strides ", cache.strides());
  TORCH_CHECK_VALUE(has_scale, op, ": ", cache_name, " is ", kv_format_name(r.format), " (dtype ",
                    cache.scalar_type(), ") but ", scale_name, " is missing; ",
                    r.format == KvFormat::Fp8 ? "give the descale (float32, (batch, kv_heads) or one element)"
                                              : "give its scales");
  const at::Tensor& sc = *scale;
  const auto lead = cache.sizes().slice(0, 3);  // (blocks, page, Hkv)
  if (r.format == KvFormat::Int8) {
    TORCH_CHECK_VALUE(!has_bias, op, ": ", bias_name, " was given but int8 is symmetric (value = code * scale); "
                      "a bias goes with the 4-bit format only");
    check_float_tensor(op, scale_name, sc, q, false);
    TORCH_CHECK_VALUE(sc.sizes() == lead, op, ": ", scale_name, " must have shape ", lead,
                      " (one scale per token per kv head, ", cache_name, "'s first three dims); got ", sc.sizes());
    r.scale = sc;
    r.head_dim = cache.size(3);
  } else if (r.format == KvFormat::Fp8) {
    TORCH_CHECK_VALUE(!has_bias, op, ": ", bias_name, " was given but float8_e4m3fn takes a descale only");
    check_float_tensor(op, scale_name, sc, q, false);
    const int64_t hkv = cache.size(2);
    r.per_tensor = sc.numel() == 1;
    TORCH_CHECK_VALUE(r.per_tensor || (sc.dim() == 2 && sc.size(0) == batch && sc.size(1) == hkv), op, ": ",
                      scale_name, " (the descale) must have shape (batch, kv_heads) = (", batch, ", ", hkv,
                      ") as flash-attn 3's ", s, "_descale, or one element (per tensor); got ", sc.sizes());
    r.scale = sc;
    r.head_dim = cache.size(3);
  } else {  // Q4
    const bool u32 = cache.scalar_type() == at::kUInt32;
    const int64_t per = u32 ? 8 : 2;
    TORCH_CHECK_VALUE(has_bias, op, ": ", cache_name, " is 4-bit (affine: value = code * scale + bias) but ",
                      bias_name, " is missing");
    check_float_tensor(op, scale_name, sc, q, true);
    check_float_tensor(op, bias_name, *bias, q, true);
    TORCH_CHECK_VALUE(sc.dim() == 4 && sc.sizes().slice(0, 3) == lead && sc.size(3) >= 1, op, ": ", scale_name,
                      " must have shape (", lead[0], ", ", lead[1], ", ", lead[2], ", head_dim / group_size) (",
                      cache_name, "'s first three dims, then one per group); got ", sc.sizes());
    TORCH_CHECK_VALUE(bias->sizes() == sc.sizes(), op, ": ", bias_name, " must have ", scale_name, "'s shape ",
                      sc.sizes(), "; got ", bias->sizes());
    r.head_dim = cache.size(3) * per;
    r.groups = sc.size(3);
    TORCH_CHECK_VALUE(r.head_dim % r.groups == 0, op, ": ", scale_name, " has ", r.groups, " groups, which do not "
                      "divide head_dim ", r.head_dim, " (", cache_name, "'s last dim ", cache.size(3), " x ", per,
                      " codes per ", u32 ? "uint32" : "uint8", ")");
    r.group_size = r.head_dim / r.groups;
    TORCH_CHECK_VALUE(r.group_size == 32 || r.group_size == 64 || r.group_size == 128, op, ": the group size ",
                      r.group_size, " (head_dim ", r.head_dim, " / ", r.groups, " groups in ", scale_name,
                      ") must be 32, 64 or 128 (MLX's); check ", cache_name, "'s last dim (head_dim / ", per,
                      " for ", u32 ? "uint32" : "uint8", " packing) and ", scale_name, "'s");
    r.scale = sc;
    r.bias = *bias;
  }
  return r;
}

}  // namespace

KvQuant check_kv_quant(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& k_bias,
                       const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& v_bias,
                       const std::string& k_format, const std::string& v_format, int64_t batch) {
  KvQuant r;
  r.k = check_side(op, "k", q, k_cache, k_scale, k_bias, k_format, batch);
  r.v = check_side(op, "v", q, v_cache, v_scale, v_bias, v_format, batch);
  return r;
}

void describe_kv_quant(const KvQuant& kq, AttentionProblem* p) {
  p->k_format = static_cast<int>(kq.k.format);
  p->v_format = static_cast<int>(kq.v.format);
  p->k_group = kq.k.group_size;
  p->v_group = kq.v.group_size;
  if (kq.k.format == KvFormat::Q4) p->k_scale_dtype = kq.k.scale.scalar_type();
  if (kq.v.format == KvFormat::Q4) p->v_scale_dtype = kq.v.scale.scalar_type();
  p->k_code_bytes = kq.k.codes.element_size();
  p->v_code_bytes = kq.v.codes.element_size();
}

void scales_for_metal(KvQuant* kq) {
  for (KvSide* s : {&kq->k, &kq->v}) {
    if (s->format != KvFormat::Q4) continue;
    if (s->scale.strides() != s->bias.strides() || (s->scale.size(3) > 1 && s->scale.stride(3) != 1)) {
      s->scale = s->scale.contiguous();
      s->bias = s->bias.contiguous();
    }
  }
}

std::array<int64_t, 3> kv_scale_strides(const KvSide& s) {
  if (s.format == KvFormat::Int8 || s.format == KvFormat::Q4) {
    return {s.scale.stride(0), s.scale.stride(1), s.scale.stride(2)};
  }
  if (s.format == KvFormat::Fp8 && !s.per_tensor) return {s.scale.stride(0), 0, s.scale.stride(1)};
  return {0, 0, 0};
}

}  // namespace flash_metal
