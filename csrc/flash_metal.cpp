// The only place flash_metal's operator schemas are defined. Backends add
// implementations with TORCH_LIBRARY_IMPL in their own files:
//   csrc/cpu/attention_cpu.cpp   CPU
//   csrc/mps/attention_mps.mm    MPS (macOS builds only)
//   csrc/metal_plan_op.cpp       metal_plan (device-independent introspection), and the
//                                routing table's ops (metal_routing_table, metal_registry_routes,
//                                metal_routing_register_family: tests only)
//   csrc/mps/pipelines.mm        metal_build_all_pipelines (macOS builds only)
//   csrc/mps/device_info.mm      metal_device_info (macOS builds; csrc/device_info.cpp elsewhere)
#include <Python.h>
#include <torch/library.h>

// `import flash_metal._C` only has to load this shared object: the static
// registrations below run at load time. The module itself is empty (the
// pattern of pytorch/extension-cpp), so no pybind11 is needed.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", /*doc=*/nullptr, /*size=*/-1, /*methods=*/nullptr,
  };
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(flash_metal, m) {
  // Exact attention, O(N) memory. q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D) with
  // Hq % Hkv == 0. Returns out (B, Hq, Nq, D) in q's dtype and the float32
  // log-sum-exp lse (B, Hq, Nq) of each row's scaled scores (natural log; -inf
  // for a row that sees no key). `impl` picks the kernel on Metal: "auto",
  // "untiled", "tiled", "prefill", "decode", "decode_split" or "tensor_ops"
  // (see csrc/metal/plan.h); CPU tensors accept "auto".
  // (Not named `kernel`: Inductor's fallback lowering reserves that keyword.)
  // The options after `impl` (compatible: older calls keep working):
  //   attn_mask: bool (True = attend) or additive (q's dtype or float32),
  //     broadcastable to (B, Hq, Nq, Nk), read through its strides (never
  //     expanded in memory); combines with causal and the window.
  //   window_left / window_right: a sliding window, bottom-right aligned as
  //     flash-attn's: query i sees keys i + Nk - Nq - window_left <= j <=
  //     i + Nk - Nq + window_right; -1 is unbounded; causal sets window_right = 0.
  //   softcap: scores s become softcap * tanh(s / softcap) before the mask
  //     and the softmax (Gemma 2); 0 is off.
  //   sinks: attention sinks (gpt-oss), (Hq,) float32 or q's dtype, on q's
  //     device, any stride: one logit per query head for a virtual key whose
  //     value is zero. Each row's softmax runs over [scores, sinks[h]] and the
  //     sink's probability is dropped; lse includes it. The sink is in the
  //     scaled scores' natural-log units, neither softcapped nor masked, so a
  //     row with every key masked gives out = 0 and lse = sinks[h]. CPU and
  //     Metal (fc_has_sinks; the backward's flash_sinks_grad).
  // B, Nq or Nk may be 0: empty outputs, or (Nk = 0) zeros with lse = -inf
  // (with sinks: lse = the sink).
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None, "
        "str impl=\"auto\", Tensor? attn_mask=None, int window_left=-1, int window_right=-1, float softcap=0.0, "
        "Tensor? sinks=None) -> (Tensor out, Tensor lse)");
  // The gradients of attention_forward (FlashAttention-2's backward with
  // recomputation: P is rebuilt from q, k and lse, never stored). out and lse
  // are attention_forward's outputs for the same q, k, v and options;
  // grad_out is the gradient of out (q's shape and dtype, any strides) and
  // grad_lse, when given, the gradient of lse ((B, Hq, Nq) float32; None
  // means zero). Returns grad_q, grad_k, grad_v packed in the shapes and
  // dtype of q, k and v; with grouped-query attention grad_k and grad_v sum
  // over each kv head's query heads. Deterministic: the same inputs give
  // bitwise-equal gradients. `impl`: "auto", or on Metal "tensor_ops"
  // (the Metal 4 tensor-op backward, shaders/tensor_ops/attention_backward_mpp.h). No gradient flows
  // into attn_mask. With sinks (the forward's), grad_sinks is the sinks'
  // gradient ((Hq,), sinks' dtype): sum over rows of P_sink * (grad_lse - D)
  // with P_sink = exp(sink - lse) and D = rowsum(grad_out * out), summed in
  // a fixed order (deterministic); without sinks it is an empty (0,) float32
  // tensor.
  m.def("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "bool causal=False, float? scale=None, Tensor? grad_lse=None, str impl=\"auto\", Tensor? attn_mask=None, "
        "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? sinks=None) "
        "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_sinks)");
  // Packed variable-length sequences (flash-attn's flash_attn_varlen_func):
  // q (total_q, Hq, D), k and v (total_k, Hkv, D); sequence b owns q rows
  // [cu_seqlens_q[b], cu_seqlens_q[b+1]) and k/v rows likewise (int32, shape
  // (B + 1,)); max_seqlen_q / max_seqlen_k bound every sequence's length.
  // causal, the window and softcap apply per sequence (bottom-right aligned
  // within each); no attn_mask. Returns out (total_q, Hq, D) and lse
  // (Hq, total_q) float32. No padding is computed and nothing is copied.
  // sinks as in attention_forward (an empty sequence's rows are none).
  m.def("attention_varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, bool causal=False, float? scale=None, int window_left=-1, "
        "int window_right=-1, float softcap=0.0, str impl=\"auto\", Tensor? sinks=None) -> (Tensor out, Tensor lse)");
  // The gradients of attention_varlen_forward, as attention_backward's:
  // grad_q (total_q, Hq, D), grad_k and grad_v (total_k, Hkv, D), grad_sinks.
  m.def("attention_varlen_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal=False, "
        "float? scale=None, Tensor? grad_lse=None, int window_left=-1, int window_right=-1, float softcap=0.0, "
        "str impl=\"auto\", Tensor? sinks=None) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_sinks)");
  // Attention against a KV cache (the attention of flash-attn's
  // flash_attn_with_kvcache; appends stay in Python, flash_metal/flash_attn.py):
  // q (B, Hq, Nq, D); k_cache (num_blocks, page_size, Hkv, D) and v_cache
  // (..., D_v), flash-attn's layout; block_table int32 (B, max_blocks):
  // sequence b's key j is row j % page_size of block block_table[b, j //
  // page_size]; cache_seqlens int32 (B,): sequence b has keys 0 ..
  // cache_seqlens[b] - 1, and nothing past them is read (cache rows, table
  // entries: they may hold anything). block_table None: a plain cache
  // (B_cache >= B, seqlen, Hkv, D), row b being sequence b. Causal and the
  // window are bottom-right aligned to each sequence's own length; softcap,
  // sinks and scale as in attention_forward. Returns out (B, Hq, Nq, D_v)
  // and lse (B, Hq, Nq) float32 (a sequence with no key: zeros and -inf, or
  // the sink). Forward only. On Metal the decode kernels read the table
  // themselves for Nq <= 8 (impl 'auto', 'decode', 'decode_split'), the
  // prefill kernel for Nq > 8 (or impl 'prefill'); for head dims past 256,
  // and on CPU, the rows in use are gathered into packed buffers for the
  // varlen kernels. With cu_seqlens_q (flash_attn_varlen_func's paged
  // prefill): q is packed (total_q, Hq, D), sequence b's queries its rows
  // cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 (max_seqlen_q at most), and
  // out (total_q, Hq, D_v) and lse (Hq, total_q) as attention_varlen_forward's;
  // on Metal the prefill kernel reads the table for them too. Values
  // (lengths within the capacity, entries in range) are checked on CPU and
  // are the caller's contract on MPS, as in flash-attn.
  // Quantized caches (issue 44; layouts in csrc/kvcache_quant.h): k_cache /
  // v_cache int8 with k_scale / v_scale float32 (num_blocks, page_size, Hkv),
  // value = code * scale; uint32 (..., D / 8) or uint8 (..., D / 2) 4-bit
  // codes in MLX's packing with scale and bias (..., Hkv, D / group_size),
  // value = code * scale + bias; float8_e4m3fn with the descale in k_scale /
  // v_scale, float32 (B, Hkv) or one element. K and V may differ. k_format /
  // v_format: 'auto' (from the dtype) or the format's name, which must match.
  // On CPU a quantized cache is read in place (decode, split, paged, chunked
  // prefill; impl 'direct' does the same for a native cache); MPS does not
  // take quantized caches yet and says so.
  m.def("attention_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table=None, "
        "bool causal=False, float? scale=None, int window_left=-1, int window_right=-1, float softcap=0.0, "
        "Tensor? sinks=None, str impl=\"auto\", Tensor? cu_seqlens_q=None, int max_seqlen_q=0, "
        "Tensor? k_scale=None, Tensor? k_bias=None, Tensor? v_scale=None, Tensor? v_bias=None, "
        "str k_format=\"auto\", str v_format=\"auto\") -> (Tensor out, Tensor lse)");
  // The Metal launch plan attention_forward (backward=True: attention_backward,
  // reading the strides of the optional grad_out, out, lse and grad_lse,
  // packed when None) would use for these inputs,
  // without running anything, one dispatch at a time (a split-KV decode has
  // two): kernel host name, threadgroups per grid, threads per threadgroup,
  // dynamic threadgroup memory in bytes and its [[threadgroup(i)]] index, the
  // boolean function constants (index = [[function_constant(i)]]), the
  // binding table (the [[buffer(n)]] of q, k, v, out, lse, partial_out,
  // partial_stats, grad_out, grad_q, grad_k, grad_v, grad_lse and delta, in
  // that order, -1 when unbound), the [[buffer(n)]] of the
  // AttentionParams bytes, those bytes, the reason for the choice, the number
  // of dispatches, and the float32 elements of the scratch tensors
  // (partial_out, partial_stats, delta). `gpu`
  // is the GPU the plan is sized for: a class ("base", "max", "ultra") or a
  // chip ("m1" ... "m5", "m3-max", "m4-pro", ...; on MPS the device's own).
  // estimate is the planner's model for this dispatch on it (LaunchEstimate:
  // live registers per lane, threadgroups and SIMD-groups resident per
  // core), occupancy_limit what bounds that residency, gpu_name the chip. Works for tensors on any device; the test suite's
  // emulated-Metal backend and flash_metal.explain() use it. attn_mask,
  // window_left, window_right and softcap as in attention_forward; with
  // cu_seqlens_q and cu_seqlens_k the plan is attention_varlen_forward's (or
  // backward's), q, k, v being the packed (total, H, D) tensors. The binding
  // table then also has attn_mask, cu_seqlens_q and cu_seqlens_k. sinks:
  // the forward kernels' fc_has_sinks (the table has sinks), and the
  // backward's third dispatch, flash_sinks_grad (sinks and grad_sinks).
  // With cache_seqlens (and block_table), attention_kvcache's plan, k and v
  // being the caches: the paged decode or prefill (the table has block_table
  // and cache_seqlens), or the gather path's varlen plan over the rows in use
  // (read from cache_seqlens and the table); the reason says which.
  // families: the routing table's verdicts, one line per kernel family
  // (csrc/metal/families/table.cpp: took the call, or why not), then the
  // composite path's.
  m.def("metal_plan(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None, str impl=\"auto\", "
        "str gpu=\"base\", int dispatch=0, bool backward=False, Tensor? grad_out=None, Tensor? out=None, "
        "Tensor? lse=None, Tensor? grad_lse=None, Tensor? attn_mask=None, int window_left=-1, int window_right=-1, "
        "float softcap=0.0, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, int max_seqlen_q=0, "
        "int max_seqlen_k=0, Tensor? sinks=None, Tensor? block_table=None, Tensor? cache_seqlens=None, "
        "Tensor? k_scale=None, Tensor? k_bias=None, Tensor? v_scale=None, Tensor? v_bias=None, "
        "str k_format=\"auto\", str v_format=\"auto\") "
        "-> (str kernel_name, int[] grid, int[] threadgroup, int threadgroup_memory, int threadgroup_memory_index, "
        "bool[] function_constants, int[] buffer_indices, int params_index, Tensor params, str reason, "
        "int num_dispatches, int[] scratch_elements, int max_threads_per_threadgroup, int[] estimate, "
        "str occupancy_limit, str gpu_name, str[] families, int quant_params_index, Tensor quant_params)");
  // macOS builds only (csrc/mps/pipelines.mm), for tests: loads the shader
  // library as attention_forward would and builds the pipeline of every
  // (kernel, function constants) pair the planner can produce, on the
  // system's Metal device. Returns where the library came from and
  // "<kernel>/<constants as 0/1 digits>" for each pipeline built.
  m.def("metal_build_all_pipelines() -> (str library, str[] pipelines)");
  // The routing tables (csrc/metal/families/table.cpp): every kernel family
  // of each pass in priority order, with its declaration (what it takes)
  // and the host names it plans (comma-separated glob patterns).
  m.def("metal_routing_table() -> (str[] passes, str[] names, str[] declares, str[] kernels)");
  // The registry of compiled kernels (csrc/metal/registry.cpp's
  // all_metal_launches): each launch's host name and the family that planned it.
  m.def("metal_registry_routes() -> (str[] kernels, str[] families)");
  // Tests only: inserts the FamilyRow at address `row` (a test double the
  // test builds and loads itself) at `position` of its pass's table; row 0
  // removes every registered one.
  m.def("metal_routing_register_family(int row, int position=0) -> ()");
  // What the Metal device, the OS and the shader library report, as JSON
  // text, for python -m flash_metal.selfcheck and CI logs. Never raises for
  // a missing device or backend: "available" is then false and "reason" says
  // why (on Linux builds, and on a Mac where PyTorch and Metal find no GPU).
  // A library that fails to load is reported in library.error, a pipeline
  // that fails to build in pipeline_errors. build_pipelines=True first builds
  // the pipeline of every (kernel, function constants) pair the planner can
  // produce (as metal_build_all_pipelines; slow the first time), else only
  // the pipelines built so far in this process are listed. Loads the shader
  // library (its fallback warnings included). Keys (schema 1), all present:
  //   schema: 1; available: bool; reason: str | null;
  //   mps_backend: bool (this build has the MPS host);
  //   macos: null | {version: "15.1.0", major, minor, patch} (what the OS
  //     reports to this binary: macOS 26 shows as 16.x to a build against an
  //     SDK older than 26);
  //   device: null | {name: str, registry_id: int, source: "torch" (PyTorch's
  //     MPS device) | "MTLCopyAllDevices" (PyTorch has none), has_unified_memory:
  //     bool, max_threadgroup_memory_length: int, max_threads_per_threadgroup:
  //     [w, h, d], families: {Apple7, Apple8, Apple9, Apple10, Mac2, Metal3,
  //     Metal4: bool, or null when this macOS predates the family and it was
  //     not asked}};
  //   library: null | {kind: "metallib" | "runtime_compile" | null, path,
  //     reason (why compiled at run time, "" for the metallib), origin: str |
  //     null, error: str | null (the load failed; the other fields null)};
  //   pipelines: [{kernel: str, function_constants: "0101...",
  //     max_total_threads_per_threadgroup, thread_execution_width,
  //     static_threadgroup_memory_length: int}], sorted by kernel, constants;
  //   pipeline_errors: [{kernel, function_constants, error: str}];
  //   tensor_ops: {usable: bool (Auto runs the Metal 4 tensor-op kernels,
  //     issue 21), reason: str | null (why not: the GPU family, the
  //     FLASH_METAL_DISABLE_TENSOR_OPS switch, a macOS older than 26.2, the
  //     MSL 4 library missing or stale), forced_reason: str | null (why
  //     impl='tensor_ops' cannot run), gpu_family: int | null (the Apple GPU
  //     family the planner takes the device for)}; both reasons from the
  //     routing's rule (csrc/metal/plan.h, tensor_ops_problem).
  m.def("metal_device_info(bool build_pipelines=False) -> str");
}
