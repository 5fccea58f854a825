// flash_metal::metal_device_info where no Metal device can be described:
// every build registers this answer ({"available": false, ...}, see
// device_info.h) under CompositeImplicitAutograd. A macOS build with the MPS
// backend also registers csrc/mps/device_info.mm under
// CompositeExplicitAutograd, and for an operator without tensor arguments
// the dispatcher prefers that one (tests/mps/test_device_info.py checks the
// preference with the MPS host's Linux build). So a caller (python -m
// flash_metal.selfcheck, CI logs) gets JSON on every platform, never a
// missing-kernel error.
#include "device_info.h"

#include <torch/library.h>

#include <string>

namespace flash_metal {
namespace {

std::string metal_device_info_unavailable(bool build_pipelines) {
  (void)build_pipelines;  // nothing to build without a device
#ifdef FLASH_METAL_WITH_MPS
  // Only reached if the MPS implementation failed to register.
  return device_info::unavailable("flash_metal's MPS device-info kernel is not registered", true);
#else
  return device_info::unavailable(
      "this flash_metal build has no MPS backend (built where torch.backends.mps.is_built() is False, e.g. "
      "Linux): there is no Metal device to describe",
      false);
#endif
}

}  // namespace

TORCH_LIBRARY_IMPL(flash_metal, CompositeImplicitAutograd, m) {
  m.impl("metal_device_info", &metal_device_info_unavailable);
}

}  // namespace flash_metal
