// Compiled (syntax only) against the REAL macOS torch headers by
// tests/test_mps_exec.py, through tests/mps_syntax/syntax_check.py: every
// at::mps entry point in include/mps_exec/mps_api.h, which the execution
// test's minimal declarations are generated from, must exist in PyTorch with
// exactly the listed type (return type, parameters, const, noexcept).
#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>

#include <type_traits>

#include "mps_exec/mps_api.h"

#define FM_CHECK_MEMBER(Class, name, Return, Params, Qualifiers)                                           \
  static_assert(std::is_same<decltype(&at::mps::Class::name), Return(at::mps::Class::*) Params Qualifiers>::value, \
                "at::mps::" #Class "::" #name ": tests/mps_exec/include/mps_exec/mps_api.h declares `" #Return   \
                " " #name #Params " " #Qualifiers "`, which is not the real header's signature");
#define FM_CHECK_STATIC(Class, name, Return, Params)                                     \
  static_assert(std::is_same<decltype(&at::mps::Class::name), Return(*) Params>::value, \
                "at::mps::" #Class "::" #name ": tests/mps_exec/include/mps_exec/mps_api.h declares `static " #Return \
                " " #name #Params "`, which is not the real header's signature");
#define FM_CHECK_FREE(name, Return, Params)                                       \
  static_assert(std::is_same<decltype(&at::mps::name), Return(*) Params>::value, \
                "at::mps::" #name ": tests/mps_exec/include/mps_exec/mps_api.h declares `" #Return " " #name #Params \
                "`, which is not the real header's signature");

namespace at::mps {
FM_MPS_STREAM_MEMBERS(FM_CHECK_MEMBER)
FM_MPS_DEVICE_MEMBERS(FM_CHECK_MEMBER)
FM_MPS_DEVICE_STATICS(FM_CHECK_STATIC)
FM_MPS_FREE_FUNCTIONS(FM_CHECK_FREE)
}  // namespace at::mps
