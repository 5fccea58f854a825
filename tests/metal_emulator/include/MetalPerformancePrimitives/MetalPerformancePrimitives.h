// Stand-in for Apple's MetalPerformancePrimitives umbrella header (MSL 4;
// compile_library(msl=4)): the emulated subset of mpp::tensor_ops.
#pragma once
#pragma clang system_header
#include <metal_stdlib>
#include <metal_tensor>
#include "../fm/mpp.h"
