// The at::mps API flash_metal's MPS host (csrc/mps/*.mm) uses, one line per
// entry. This list is the single source of two things:
//   - the minimal declarations the execution test compiles the host against
//     (ATen/mps/MPSStream.h, MPSDevice.h and MPSProfiler.h next to this
//     directory),
//   - api_check.mm, which the syntax check compiles against the REAL macOS
//     torch headers, asserting that each entry exists there with exactly the
//     listed type.
// So the test's declarations cannot drift from PyTorch's: a member added here
// is checked there, and nothing is declared that is not listed here.
//
// Entries (Return and the parameter lists may not contain top-level commas
// outside their parentheses):
//   member: X(Class, name, Return, (ParamTypes), Qualifiers, (Declaration))
//           a non-static member function; Declaration is its parameter list
//           as the fake declares it, default arguments included (a default's
//           value is the one thing api_check.mm cannot compare: keep it
//           copied from PyTorch's header)
//   static: X(Class, name, Return, (ParamTypes))  a static member function
//   free:   X(name, Return, (ParamTypes))         a function in namespace at::mps
//   enumerator: X(Enum, name, value)              an enumerator and its value
#pragma once

#define FM_MPS_STREAM_MEMBERS(X)                                      \
  X(MPSStream, commandEncoder, id<MTLComputeCommandEncoder>, (), , ()) \
  X(MPSStream, queue, dispatch_queue_t, (), const, ())

#define FM_MPS_DEVICE_MEMBERS(X) X(MPSDevice, device, id<MTLDevice>, (), , ())

#define FM_MPS_DEVICE_STATICS(X) X(MPSDevice, getInstance, MPSDevice*, ())

#define FM_MPS_PROFILER_MEMBERS(X)                                                                      \
  X(Profiler::MPSProfiler, beginProfileKernel, uint64_t, (const void*, const std::string&, const TensorList&), , \
    (const void* handle, const std::string& kernelName, const TensorList& tensors))                    \
  X(Profiler::MPSProfiler, endProfileKernel, void, (const void*, SyncType), ,                           \
    (const void* handle, SyncType syncType = SyncType::NONE))

#define FM_MPS_STREAM_FUNCTIONS(X) X(getCurrentMPSStream, MPSStream*, ())

#define FM_MPS_PROFILER_FUNCTIONS(X) X(getMPSProfiler, Profiler::MPSProfiler&, ())

#define FM_MPS_SYNC_TYPES(X) X(SyncType, NONE, 0)
