// The at::mps entry points flash_metal's MPS host (csrc/mps/*.mm) calls, one
// line each. This list is the single source of two things:
//   - the minimal declarations the execution test compiles the host against
//     (ATen/mps/MPSStream.h and ATen/mps/MPSDevice.h next to this directory),
//   - api_check.mm, which the syntax check compiles against the REAL macOS
//     torch headers, asserting that each entry has exactly the signature
//     declared here.
// So the test's declarations cannot drift from PyTorch's: a member added here
// is checked there, and nothing is declared that is not listed here.
//
// Entries (Return and Params may not contain top-level commas):
//   member: X(Class, name, Return, (Params), Qualifiers)  non-static member function
//   static: X(Class, name, Return, (Params))              static member function
//   free:   X(name, Return, (Params))                     function in namespace at::mps
#pragma once

#define FM_MPS_STREAM_MEMBERS(X)                                  \
  X(MPSStream, commandEncoder, id<MTLComputeCommandEncoder>, (), ) \
  X(MPSStream, queue, dispatch_queue_t, (), const)

#define FM_MPS_DEVICE_MEMBERS(X) X(MPSDevice, device, id<MTLDevice>, (), )

#define FM_MPS_DEVICE_STATICS(X) X(MPSDevice, getInstance, MPSDevice*, ())

#define FM_MPS_FREE_FUNCTIONS(X) X(getCurrentMPSStream, MPSStream*, ())
