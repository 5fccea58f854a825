// Compiled (syntax only) against the REAL macOS torch headers by
// tests/mps/test_mps_exec.py, through tests/mps_syntax/syntax_check.py: every
// at::mps entry in include/mps_exec/mps_api.h, which the execution test's
// minimal declarations are generated from, must exist in PyTorch with exactly
// the listed type. Taking the address through a static_cast to the listed
// pointer type selects the one overload with that exact type (return,
// parameters, const), or fails to compile.
#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSProfiler.h>
#include <ATen/mps/MPSStream.h>

#include "mps_exec/mps_api.h"

namespace at::mps {
namespace {

template <class T>
constexpr bool fm_exists(T) {
  return true;
}

#define FM_CHECK_MEMBER(Class, name, Return, ParamTypes, Qualifiers, Declaration)                      \
  static_assert(fm_exists(static_cast<Return (Class::*) ParamTypes Qualifiers>(&Class::name)),         \
                "at::mps::" #Class "::" #name ": see tests/mps_exec/include/mps_exec/mps_api.h");
#define FM_CHECK_STATIC(Class, name, Return, ParamTypes)                                 \
  static_assert(fm_exists(static_cast<Return(*) ParamTypes>(&Class::name)), \
                "at::mps::" #Class "::" #name ": see tests/mps_exec/include/mps_exec/mps_api.h");
#define FM_CHECK_FREE(name, Return, ParamTypes)                                          \
  static_assert(fm_exists(static_cast<Return(*) ParamTypes>(&at::mps::name)), \
                "at::mps::" #name ": see tests/mps_exec/include/mps_exec/mps_api.h");
#define FM_CHECK_ENUMERATOR(Enum, name, value)                                    \
  static_assert(static_cast<long long>(Enum::name) == (value),                    \
                "at::mps::" #Enum "::" #name " has another value in PyTorch");

using Profiler::MPSProfiler;
FM_MPS_STREAM_MEMBERS(FM_CHECK_MEMBER)
FM_MPS_DEVICE_MEMBERS(FM_CHECK_MEMBER)
FM_MPS_PROFILER_MEMBERS(FM_CHECK_MEMBER)
FM_MPS_DEVICE_STATICS(FM_CHECK_STATIC)
FM_MPS_STREAM_FUNCTIONS(FM_CHECK_FREE)
FM_MPS_PROFILER_FUNCTIONS(FM_CHECK_FREE)
FM_MPS_SYNC_TYPES(FM_CHECK_ENUMERATOR)

}  // namespace
}  // namespace at::mps
