// MetalPerformanceShadersGraph: only the classes PyTorch's MPSStream.h names.
// Syntax-check stub (tests/mps/test_mps_host.py), never compiled into anything.
#pragma once

#include <MetalPerformanceShaders/MetalPerformanceShaders.h>

// https://developer.apple.com/documentation/metalperformanceshadersgraph/mpsgraphobject?language=objc
@interface MPSGraphObject : NSObject
@end
// https://developer.apple.com/documentation/metalperformanceshadersgraph/mpsgraph?language=objc
@interface MPSGraph : MPSGraphObject
@end
// https://developer.apple.com/documentation/metalperformanceshadersgraph/mpsgraphexecutiondescriptor?language=objc
@interface MPSGraphExecutionDescriptor : MPSGraphObject
@end
// https://developer.apple.com/documentation/metalperformanceshadersgraph/mpsgraphcompilationdescriptor?language=objc
@interface MPSGraphCompilationDescriptor : MPSGraphObject
@end
