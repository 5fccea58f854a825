// flash_metal::metal_build_all_pipelines, a test-facing entry point (macOS
// builds only): builds, with the real Metal framework, the pipeline of every
// (kernel name, function constants) pair the portable planner can return,
// through the same loader and cache attention_forward uses. On a machine
// whose GPU cannot run kernels (GitHub's hosted macOS runners), this still
// proves that the metallib loads, is not stale, holds
// every instantiation the planner names, and that Metal accepts each one.
#include "library.h"
#include "metal_plan.h"

#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

namespace flash_metal::mps {
namespace {

std::tuple<std::string, std::vector<std::string>> metal_build_all_pipelines() {
  // PyTorch's MPS device, else any Metal device (library.h, metal_device):
  // pipeline creation needs only a device, and a CI runner's may be one
  // PyTorch declines.
  id<MTLDevice> device = metal_device();
  TORCH_CHECK(device != nil, "flash_metal.metal_build_all_pipelines: this machine has no Metal device");
  std::vector<std::string> built;
  for (const MetalLaunch& launch : all_metal_launches()) {
    const Pipeline pipeline = get_pipeline(device, launch.kernel_name, launch.function_constants);
    TORCH_CHECK(pipeline.max_threads_per_threadgroup >= uint64_t{launch.threadgroup[0]} * launch.threadgroup[1] *
                                                            launch.threadgroup[2],
                "flash_metal: the pipeline of ", launch.kernel_name, " admits ", pipeline.max_threads_per_threadgroup,
                " threads per threadgroup, fewer than the planner launches");
    std::string constants;
    for (bool c : launch.function_constants) constants += c ? '1' : '0';
    built.push_back(launch.kernel_name + "/" + constants);
  }
  return {library_origin(device), built};
}

}  // namespace

// No tensor arguments, so no backend key to dispatch on: the composite key
// serves every call.
TORCH_LIBRARY_IMPL(flash_metal, CompositeExplicitAutograd, m) {
  m.impl("metal_build_all_pipelines", &metal_build_all_pipelines);
}

}  // namespace flash_metal::mps
