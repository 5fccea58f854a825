// Building many pipelines at once, and flash_metal::metal_build_all_pipelines,
// a test-facing entry point (macOS builds only): builds, with the real Metal
// framework, the pipeline of every (kernel name, function constants) pair the
// portable planner can return, through the same loader and cache
// attention_forward uses. On a machine whose GPU cannot run kernels (GitHub's
// hosted macOS runners), this still proves that the metallib loads, is not
// stale, holds every instantiation the planner names, and that Metal accepts
// each one.
//
// Concurrency. There are hundreds of pipelines, and one at a time they take
// minutes on a CI runner. get_pipelines builds them with dispatch_apply on a
// global concurrent queue: synchronous like a loop, as many worker threads as
// the machine has cores, and both halves of each build (specializing the
// function's constants, compiling the pipeline) overlap across iterations.
// Metal's asynchronous newComputePipelineStateWithFunction:completionHandler:
// was the alternative; it would need a dispatch group to wait on, completion
// blocks that must copy and retain what they capture under manual
// retain/release, a separate asynchronous call for the specialization, and
// it would issue every request at once instead of one per core. Each
// iteration writes only its own result; nothing in the block can throw
// (try_get_pipeline reports errors as strings), and no PyTorch call runs
// there. Not yet verified on Apple hardware: that Metal's compiler service
// takes concurrent requests from one process without trouble (MoltenVK
// serialized its function specializations after a 2020 report of a crash
// with concurrent ones on the same library, KhronosGroup/MoltenVK#961).
#include "library.h"
#include "metal/plan.h"

#include <dispatch/dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace flash_metal::mps {

std::vector<PipelineResult> get_pipelines(id<MTLDevice> device, const std::vector<PipelineRequest>& requests) {
  (void)library_origin(device);  // loads the library here, where its errors may throw
  std::vector<PipelineResult> results(requests.size());
  if (requests.empty()) return results;
  // Raw pointers: a block captures C++ objects by const copy.
  PipelineResult* out = results.data();
  const PipelineRequest* in = requests.data();
  dispatch_apply(requests.size(), dispatch_get_global_queue(DISPATCH_QUEUE_PRIORITY_DEFAULT, 0), ^(size_t i) {
    out[i] = try_get_pipeline(device, in[i].kernel_name, in[i].constants);
  });
  return results;
}

namespace {

std::string constants_of(const std::vector<bool>& constants) {
  std::string s;
  for (bool c : constants) s += c ? '1' : '0';
  return s;
}

std::tuple<std::string, std::vector<std::string>> metal_build_all_pipelines() {
  // PyTorch's MPS device, else any Metal device (library.h, metal_device):
  // pipeline creation needs only a device, and a CI runner's may be one
  // PyTorch declines.
  id<MTLDevice> device = metal_device();
  TORCH_CHECK(device != nil, "flash_metal.metal_build_all_pipelines: this machine has no Metal device");
  const std::vector<MetalLaunch> launches = all_metal_launches();
  std::vector<PipelineRequest> requests;
  for (const MetalLaunch& launch : launches) requests.push_back({launch.kernel_name, launch.function_constants});
  const std::vector<PipelineResult> results = get_pipelines(device, requests);

  // Every failure, in the planner's order, then one error naming them all.
  std::vector<std::string> built;
  std::string failures;
  size_t failed = 0;
  for (size_t i = 0; i < launches.size(); ++i) {
    const MetalLaunch& launch = launches[i];
    const std::string entry = launch.kernel_name + "/" + constants_of(launch.function_constants);
    // The planner may launch this kernel with up to the N its
    // [[max_total_threads_per_threadgroup(N)]] declares (launch.
    // max_threads_per_threadgroup, never below this launch's own size): a
    // pipeline admitting fewer would fail some shape at run time, so it fails here.
    const uint64_t planned = std::max<uint64_t>(
        uint64_t{launch.threadgroup[0]} * launch.threadgroup[1] * launch.threadgroup[2],
        launch.max_threads_per_threadgroup);
    std::string problem = results[i].error;
    if (problem.empty() && results[i].pipeline.max_threads_per_threadgroup < planned) {
      problem = "the pipeline admits " + std::to_string(results[i].pipeline.max_threads_per_threadgroup) +
                " threads per threadgroup, fewer than the " + std::to_string(planned) +
                " the planner may launch it with";
    }
    if (problem.empty()) {
      built.push_back(entry);
    } else {
      ++failed;
      failures += "\n  " + entry + ": " + problem;
    }
  }
  TORCH_CHECK(failed == 0, "flash_metal.metal_build_all_pipelines: ", failed, " of ", launches.size(),
              " pipelines failed (<kernel>/<function constants>):", failures);
  return {library_origin(device), built};
}

}  // namespace

// No tensor arguments, so no backend key to dispatch on: the composite key
// serves every call.
TORCH_LIBRARY_IMPL(flash_metal, CompositeExplicitAutograd, m) {
  m.impl("metal_build_all_pipelines", &metal_build_all_pipelines);
}

}  // namespace flash_metal::mps
