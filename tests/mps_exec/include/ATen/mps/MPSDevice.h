// Test-only stand-in for PyTorch's <ATen/mps/MPSDevice.h>: only what
// mps_exec/mps_api.h lists, which api_check.mm checks against the real macOS
// header. Defined by tests/mps_exec/fake_mps.mm. Never shipped.
#pragma once

#include <Metal/Metal.h>

#include "mps_exec/mps_api.h"

namespace at::mps {

#define FM_DECLARE_MEMBER(Class, name, Return, ParamTypes, Qualifiers, Declaration) \
  Return name Declaration Qualifiers;
#define FM_DECLARE_STATIC(Class, name, Return, ParamTypes) static Return name ParamTypes;

class MPSDevice {
 public:
  FM_MPS_DEVICE_STATICS(FM_DECLARE_STATIC)
  FM_MPS_DEVICE_MEMBERS(FM_DECLARE_MEMBER)
};

#undef FM_DECLARE_MEMBER
#undef FM_DECLARE_STATIC

}  // namespace at::mps
