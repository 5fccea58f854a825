// MetalPerformanceShaders: only the class PyTorch's MPSStream.h names.
// Syntax-check stub (tests/mps/test_mps_host.py), never compiled into anything.
#pragma once

#include <Metal/Metal.h>

// https://developer.apple.com/documentation/metalperformanceshaders/mpscommandbuffer?language=objc
@interface MPSCommandBuffer : NSObject <MTLCommandBuffer>
@end
