// The instantiation registry: every (kernel name, function constants) pair
// the planner can produce, found by planning small problems of every branch
// (so it cannot drift from the planner), each at its largest threadgroup.
// The macOS pipeline test builds each; the emulator tests compare the names
// with the metallib's.
#include "metal/plan_detail.h"

namespace flash_metal {

using namespace plan_detail;

std::vector<MetalLaunch> all_metal_launches() {
  std::vector<MetalLaunch> launches;
  // One entry per (kernel, function constants), planned at the largest
  // threadgroup any of the shapes below gives it: the pipeline check
  // (csrc/mps/pipelines.mm) then compares the pipeline's limit with the most
  // threads the planner launches it with.
  auto add = [&](const MetalLaunch& l) {
    for (MetalLaunch& seen : launches) {
      if (seen.kernel_name == l.kernel_name && seen.function_constants == l.function_constants) {
        if (threads_of(l) > threads_of(seen)) seen = l;
        return;
      }
    }
    launches.push_back(l);
  };
  // Problem sizes reaching every branch: q/k lengths that are multiples of
  // every block (64) and lengths that are not (65), one decode row with a
  // short and a long context (one row group: 8 key groups, 256 threads), and
  // a 16-head GQA group of 8 decode rows (16 or more row groups: row chunks
  // of 8 SIMD-groups staging K/V, 256 threads), and a 4-head GQA group in the
  // prefill, short enough to pack (fc_pack_gqa: 2 * Nq <= BQ in every
  // bucket), its packed rows (4 x 8, 4 x 7) aligned or not.
  struct Shape { int64_t q_len, kv_len; KernelRequest request; int64_t q_heads = 1; };
  const Shape shapes[] = {
      {64, 64, KernelRequest::Untiled}, {64, 64, KernelRequest::Tiled},
      {64, 64, KernelRequest::Prefill}, {65, 64, KernelRequest::Prefill},
      {64, 65, KernelRequest::Prefill}, {65, 65, KernelRequest::Prefill},
      {1, 64, KernelRequest::Decode},   {1, 4096, KernelRequest::DecodeSplit},
      {8, 64, KernelRequest::Decode, 16}, {8, 4096, KernelRequest::DecodeSplit, 16},
      {8, 64, KernelRequest::Prefill, 4}, {7, 65, KernelRequest::Prefill, 4},
  };
  // The options, one at a time (the loops below), causal or not: their
  // combinations are the same constants switched together, so these cover
  // every code path each constant guards; the pipelines a combination needs
  // are built on first use like any other. Paged: fc_paged (attention_kvcache).
  enum Option { NoOption, BoolMask, InputMask, Float32Mask, WindowLeft, Softcap, Varlen, Sinks, Paged };
  const auto set_option = [](AttentionProblem& p, Option option, bool causal) {
    p.window_right = causal ? 0 : -1;
    p.causal = causal;
    p.mask = option == BoolMask ? MaskKind::Bool
             : option == InputMask ? MaskKind::Input
             : option == Float32Mask ? MaskKind::Float32 : MaskKind::None;
    p.window_left = option == WindowLeft ? 16 : -1;
    p.softcap = option == Softcap ? 30.0 : 0.0;
    p.varlen = option == Varlen;
    p.sinks = option == Sinks;  // the forward kernels' fc_has_sinks, and flash_sinks_grad
    p.paged = option == Paged;
    p.page_size = p.table_stride = p.paged ? 16 : 0;
  };
  for (c10::ScalarType dtype : {c10::ScalarType::Float, c10::ScalarType::Half, c10::ScalarType::BFloat16}) {
    for (uint32_t d : kFastHeadDimBuckets) {
      for (const Shape& shape : shapes) {
        for (bool causal : {false, true}) {
          AttentionProblem p;
          p.batch = p.kv_heads = 1;
          p.q_heads = shape.q_heads;
          p.q_len = shape.q_len;
          p.kv_len = shape.kv_len;
          p.head_dim = d;
          p.head_dim_v = d;
          p.causal = causal;
          p.scale = 1.0;
          p.dtype = dtype;
          const int64_t D = d, H = p.q_heads, N = p.q_len, M = p.kv_len;
          const LaunchStrides packed{{H * N * D, N * D, D, 1}, {M * D, M * D, D, 1}, {M * D, M * D, D, 1},
                                     {H * N * D, N * D, D, 1}, {H * N, N, 1}};
          for (const MetalLaunch& l : plan_metal_attention(p, packed, shape.request).launches) add(l);
          // Known zero storage offsets: the prefill kernel's dense loader (fc_dense).
          LaunchStrides known = packed;
          known.offsets = {0, 0, 0, 0};
          for (const MetalLaunch& l : plan_metal_attention(p, known, shape.request).launches) add(l);
        }
      }
      // The quantized-cache decode (attention_kvcache, issue 44): a paged
      // 16-head GQA group of 8 rows (256 threads), one pass and split, each
      // format on both sides (4-bit with float32 and float16 scales: the
      // 4-bit format needs D a multiple of 32, so never 72 or 80), and int8
      // K beside V in q's dtype.
      struct QuantSides { int k, v; c10::ScalarType scales; };
      const QuantSides quant_sides[] = {{1, 1, c10::ScalarType::Float}, {2, 2, c10::ScalarType::Float},
                                        {2, 2, c10::ScalarType::Half}, {3, 3, c10::ScalarType::Float},
                                        {1, 0, c10::ScalarType::Float}};
      for (const QuantSides& qs : quant_sides) {
        if ((qs.k == 2 || qs.v == 2) && d % 32 != 0) continue;
        for (const auto& [kv_len, request] : {std::pair<int64_t, KernelRequest>{64, KernelRequest::Decode},
                                              std::pair<int64_t, KernelRequest>{4096, KernelRequest::DecodeSplit}}) {
          AttentionProblem p;
          p.batch = p.kv_heads = 1;
          p.q_heads = 16;
          p.q_len = p.total_q = 8;
          p.kv_len = p.total_k = kv_len;
          p.head_dim = p.head_dim_v = d;
          p.scale = 1.0;
          p.dtype = dtype;
          p.paged = true;
          p.page_size = p.table_stride = 16;
          p.k_format = qs.k;
          p.v_format = qs.v;
          p.k_scale_dtype = p.v_scale_dtype = qs.scales;
          p.k_group = p.v_group = 32;
          p.k_code_bytes = p.v_code_bytes = 1;
          const int64_t D = d;
          const LaunchStrides packed{{128 * D, 8 * D, D, 1}, {16 * D, D, D, 1}, {16 * D, D, D, 1},
                                     {128 * D, 8 * D, D, 1}, {128, 8, 1}};
          for (const MetalLaunch& l : plan_metal_attention(p, packed, request).launches) add(l);
        }
      }
      // The backward: both kernels, every alignment of either side (its
      // blocks are at most 32, so 64 is aligned and 65 is not), causal or
      // not, with and without grad_lse.
      for (const int64_t q_len : {64, 65}) {
        for (const int64_t kv_len : {64, 65}) {
          for (bool causal : {false, true}) {
            for (bool grad_lse : {false, true}) {
              AttentionProblem p;
              p.batch = p.q_heads = p.kv_heads = 1;
              p.q_len = q_len;
              p.kv_len = kv_len;
              p.head_dim = d;
              p.head_dim_v = d;
              p.causal = causal;
              p.scale = 1.0;
              p.dtype = dtype;
              const int64_t D = d;
              const LaunchStrides packed{{D, D, D, 1}, {D, D, D, 1}, {D, D, D, 1}, {D, D, D, 1}, {1, 1, 1},
                                         {D, D, D, 1}, {1, 1, 1}};
              for (const MetalLaunch& l : plan_metal_attention_backward(p, packed, grad_lse).launches) add(l);
              LaunchStrides known = packed;  // the dense loader (fc_dense)
              known.offsets = {0, 0, 0, 0};
              for (const MetalLaunch& l : plan_metal_attention_backward(p, known, grad_lse).launches) add(l);
            }
          }
        }
      }
      // The options, one at a time, causal or not, on every feature family
      // (their combinations are the same constants switched together, so
      // these cover every code path each constant guards; the pipelines a
      // combination needs are built on first use like any other).
      // Paged: fc_paged (attention_kvcache), the decode kernels and the prefill.
      for (Option option : {BoolMask, InputMask, Float32Mask, WindowLeft, Softcap, Varlen, Sinks, Paged}) {
        for (bool causal : {false, true}) {
          AttentionProblem p;
          p.batch = p.q_heads = p.kv_heads = 1;
          p.head_dim = d;
          p.head_dim_v = d;
          p.scale = 1.0;
          p.dtype = dtype;
          set_option(p, option, causal);
          const int64_t D = d;
          const LaunchStrides packed{{D, D, D, 1}, {D, D, D, 1}, {D, D, D, 1}, {D, D, D, 1}, {1, 1, 1},
                                     {D, D, D, 1}, {1, 1, 1}, {0, 0, 64, 1}};
          const std::array<std::pair<int64_t, KernelRequest>, 3> forward = {
              {{65, KernelRequest::Prefill}, {1, KernelRequest::Decode}, {1, KernelRequest::DecodeSplit}}};
          for (const auto& [q_len, request] : forward) {
            if (p.varlen && request != KernelRequest::Prefill) continue;
            p.q_len = p.total_q = q_len;
            p.kv_len = p.total_k = request == KernelRequest::DecodeSplit ? 4096 : 65;
            for (const MetalLaunch& l : plan_metal_attention(p, packed, request).launches) add(l);
          }
          if (p.paged) continue;  // no backward reads a paged cache
          p.q_len = p.kv_len = p.total_q = p.total_k = 65;
          for (bool grad_lse : {false, true}) {
            for (const MetalLaunch& l : plan_metal_attention_backward(p, packed, grad_lse).launches) add(l);
          }
        }
      }
    }
  }
  // The decode-only buckets (512, 576; decode_takes_wide_dims): the decode
  // shapes above of at most 16 query rows per kv head (kWideDecodeMaxRows:
  // one row, a short and a long context), causal or not, with each decode
  // option on its own as above (paged: the widest live-value count,
  // shaders/common/attention_decode_paged.h), at Gemma's 512 (fc_dense too, with
  // known zero offsets) and at MLA's (576, 512): D_v stops at 512
  // (kMaxHeadDimV), so the 576 bucket is never dense.
  for (c10::ScalarType dtype : {c10::ScalarType::Float, c10::ScalarType::Half, c10::ScalarType::BFloat16}) {
    for (const auto& [d, dv] : {std::pair<int64_t, int64_t>{512, 512}, {576, 512}}) {
      for (const Shape& shape : shapes) {
        if (shape.request != KernelRequest::Decode && shape.request != KernelRequest::DecodeSplit) continue;
        if (shape.q_heads * shape.q_len > 16) continue;
        for (bool causal : {false, true}) {
          for (Option option : {NoOption, BoolMask, InputMask, Float32Mask, WindowLeft, Softcap, Sinks, Paged}) {
            AttentionProblem p;
            p.batch = p.kv_heads = 1;
            p.q_heads = shape.q_heads;
            p.q_len = p.total_q = shape.q_len;
            p.kv_len = p.total_k = shape.kv_len;
            p.head_dim = d;
            p.head_dim_v = dv;
            p.scale = 1.0;
            p.dtype = dtype;
            set_option(p, option, causal);
            const int64_t H = p.q_heads, N = p.q_len, M = p.kv_len;
            const LaunchStrides packed{{H * N * d, N * d, d, 1}, {M * d, M * d, d, 1}, {M * dv, M * dv, dv, 1},
                                       {H * N * dv, N * dv, dv, 1}, {H * N, N, 1}, {0, 0, 0, 0}, {0, 0, 0},
                                       {0, 0, M, 1}};
            for (const MetalLaunch& l : plan_metal_attention(p, packed, shape.request).launches) add(l);
            LaunchStrides known = packed;  // known zero offsets: fc_dense where D = D_v = the bucket
            known.offsets = {0, 0, 0, 0};
            for (const MetalLaunch& l : plan_metal_attention(p, known, shape.request).launches) add(l);
          }
        }
      }
    }
  }
  // The split-D forward (splitd_takes) at (512, 512), (576, 512) and
  // (256, 512): impl='prefill', causal or not, ragged (65 rows), each option
  // on its own as above but paged (it reads no paged cache: the gather path
  // packs the pages first); and at (576, 512) the absorbed-MLA decode packed
  // over 16 query heads on one kv head (fc_pack_gqa), each option likewise,
  // at 65 keys (one pass) and 4,096 (split along keys: fc_split_kv, then
  // flash_decode_merge at D_v 512).
  // The split-D backward at (512, 512) (splitd_backward_takes), with and
  // without grad_lse; with sinks, flash_sinks_grad (already listed) after it.
  for (c10::ScalarType dtype : {c10::ScalarType::Float, c10::ScalarType::Half, c10::ScalarType::BFloat16}) {
    for (const auto& [d, dv] : {std::pair<int64_t, int64_t>{512, 512}, {576, 512}, {256, 512}}) {
      for (bool pack : {false, true}) {
        if (pack && d != 576) continue;
        for (int64_t nk : pack ? std::vector<int64_t>{65, 4096} : std::vector<int64_t>{65}) {
          for (bool causal : {false, true}) {
            for (Option option : {NoOption, BoolMask, InputMask, Float32Mask, WindowLeft, Softcap, Varlen, Sinks}) {
              AttentionProblem p;
              p.batch = p.kv_heads = 1;
              p.q_heads = pack ? 16 : 1;
              p.q_len = p.total_q = pack ? 1 : 65;
              p.kv_len = p.total_k = nk;
              p.head_dim = d;
              p.head_dim_v = dv;
              p.scale = 1.0;
              p.dtype = dtype;
              set_option(p, option, causal);
              const int64_t H = p.q_heads, N = p.q_len, M = p.kv_len;
              const LaunchStrides packed{{H * N * d, N * d, d, 1}, {M * d, M * d, d, 1}, {M * dv, M * dv, dv, 1},
                                         {H * N * dv, N * dv, dv, 1}, {H * N, N, 1}, {0, 0, 0, 0}, {0, 0, 0},
                                         {0, 0, M, 1}};
              for (const MetalLaunch& l : plan_metal_attention(p, packed, KernelRequest::Prefill).launches) add(l);
              if (d != 512 || pack) continue;
              const LaunchStrides bwd{packed.q, packed.k, packed.v, packed.o, packed.lse, packed.q, packed.lse,
                                      packed.mask};
              for (bool grad_lse : {false, true}) {
                for (const MetalLaunch& l :
                     plan_metal_attention_backward(p, bwd, grad_lse, KernelRequest::Prefill).launches)
                  add(l);
              }
            }
          }
        }
      }
    }
  }
  for (const MetalLaunch& l : launches) {
    const auto starts = [&](const char* prefix) { return l.kernel_name.rfind(prefix, 0) == 0; };
    const bool decode = starts("flash_decode_") && !starts("flash_decode_merge_");
    TORCH_CHECK(!decode || threads_of(l) == kDecodeMaxThreads, kOp, ": internal error: all_metal_launches plans ",
                l.kernel_name, " with ", threads_of(l), " threads, not the planner's largest, ", kDecodeMaxThreads);
  }
  return launches;
}

std::vector<std::string> all_metal_kernel_names() {
  std::vector<std::string> names;
  for (const MetalLaunch& l : all_metal_launches()) {
    if (std::find(names.begin(), names.end(), l.kernel_name) == names.end()) names.push_back(l.kernel_name);
  }
  return names;
}

}  // namespace flash_metal
