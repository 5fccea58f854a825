// Test-only stand-in for PyTorch's <ATen/mps/MPSStream.h>: only what
// mps_exec/mps_api.h lists, which api_check.mm checks against the real macOS
// header. Defined by tests/mps_exec/fake_mps.mm. Never shipped.
#pragma once

#include <ATen/mps/MPSDevice.h>
#include <Metal/Metal.h>
#include <dispatch/dispatch.h>

#include "mps_exec/mps_api.h"

namespace at::mps {

#define FM_DECLARE_ENUMERATOR(Enum, name, value) name = value,
enum class SyncType { FM_MPS_SYNC_TYPES(FM_DECLARE_ENUMERATOR) };
#undef FM_DECLARE_ENUMERATOR

class MPSStream {
 public:
#define FM_DECLARE_MEMBER(Class, name, Return, ParamTypes, Qualifiers, Declaration) \
  Return name Declaration Qualifiers;
  FM_MPS_STREAM_MEMBERS(FM_DECLARE_MEMBER)
#undef FM_DECLARE_MEMBER
};

#define FM_DECLARE_FREE(name, Return, ParamTypes) Return name ParamTypes;
FM_MPS_STREAM_FUNCTIONS(FM_DECLARE_FREE)
#undef FM_DECLARE_FREE

}  // namespace at::mps
