// Test-only stand-in for PyTorch's <ATen/mps/MPSStream.h>: only what
// mps_exec/mps_api.h lists, which api_check.mm checks against the real macOS
// header. Defined by tests/mps_exec/fake_mps.mm. Never shipped.
#pragma once

#include <ATen/mps/MPSDevice.h>
#include <Metal/Metal.h>
#include <dispatch/dispatch.h>

#include "mps_exec/mps_api.h"

namespace at::mps {

class MPSStream;

#define FM_DECLARE_MEMBER(Class, name, Return, Params, Qualifiers) Return name Params Qualifiers;
#define FM_DECLARE_FREE(name, Return, Params) Return name Params;

class MPSStream {
 public:
  FM_MPS_STREAM_MEMBERS(FM_DECLARE_MEMBER)
};

FM_MPS_FREE_FUNCTIONS(FM_DECLARE_FREE)

#undef FM_DECLARE_MEMBER
#undef FM_DECLARE_FREE

}  // namespace at::mps
