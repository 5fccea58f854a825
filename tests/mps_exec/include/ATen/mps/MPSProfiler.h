// Test-only stand-in for PyTorch's <ATen/mps/MPSProfiler.h>: only what
// mps_exec/mps_api.h lists, which api_check.mm checks against the real macOS
// header. Defined by tests/mps_exec/fake_mps.mm (it records the calls).
// Never shipped.
#pragma once

#include <ATen/Tensor.h>
#include <ATen/mps/MPSStream.h>

#include <cstdint>
#include <string>

#include "mps_exec/mps_api.h"

namespace at::mps {
namespace Profiler {

class MPSProfiler {
 public:
#define FM_DECLARE_MEMBER(Class, name, Return, ParamTypes, Qualifiers, Declaration) \
  Return name Declaration Qualifiers;
  FM_MPS_PROFILER_MEMBERS(FM_DECLARE_MEMBER)
#undef FM_DECLARE_MEMBER
};

}  // namespace Profiler

#define FM_DECLARE_FREE(name, Return, ParamTypes) Return name ParamTypes;
FM_MPS_PROFILER_FUNCTIONS(FM_DECLARE_FREE)
#undef FM_DECLARE_FREE

}  // namespace at::mps
