// Correct calls of real Metal and PyTorch MPS API that csrc/mps/ does not
// (all) make today. tests/mps/test_mps_host.py syntax-checks this file: the stubs
// must accept every correct call (a correct change to the host must never
// fail the check), and, edited by that test, reject a misspelled selector
// and a wrong argument type. Never compiled into anything.
#include <ATen/mps/MPSProfiler.h>
#include <ATen/mps/MPSStream.h>
#include <Metal/Metal.h>

#include <string>

void real_api_sample(id<MTLComputePipelineState> pipeline, id<MTLBuffer> buffer, const at::Tensor& t) {
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  id<MTLDevice> device = stream->device();
  const MTLSize threads = MTLSizeMake(1024, 1, 1);
  const MTLSize group = MTLSizeMake([pipeline threadExecutionWidth], 1, 1);
  const MTLSize device_limit = [device maxThreadsPerThreadgroup];
  const bool apple7 = [device supportsFamily:MTLGPUFamilyApple7] && [device hasUnifiedMemory];
  const std::string kernel = "sample";
  dispatch_sync(stream->queue(), ^{
    @autoreleasepool {
      id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();
      at::mps::getMPSProfiler().beginProfileKernel(pipeline, kernel, {t});
      [encoder setComputePipelineState:pipeline];
      id<MTLBuffer> buffers[2] = {buffer, buffer};
      const NSUInteger offsets[2] = {0, 256};
      [encoder setBuffers:buffers offsets:offsets withRange:NSMakeRange(0, 2)];
      [encoder setBufferOffset:16 atIndex:1];
      [encoder useResource:buffer usage:MTLResourceUsageRead | MTLResourceUsageWrite];
      [encoder memoryBarrierWithScope:MTLBarrierScopeBuffers];
      [encoder dispatchThreads:threads threadsPerThreadgroup:group];
      at::mps::getMPSProfiler().endProfileKernel(pipeline);
    }
  });
  MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
  if (@available(macOS 15.0, *)) {
    [options setMathMode:MTLMathModeSafe];
    [options setLanguageVersion:MTLLanguageVersion3_2];
  } else {
    [options setFastMathEnabled:NO];
  }
  MTLFunctionConstantValues* values = [[MTLFunctionConstantValues alloc] init];
  const uint32_t width = static_cast<uint32_t>(device_limit.width) + (apple7 ? 1u : 0u);
  [values setConstantValue:&width type:MTLDataTypeUInt withName:[NSString stringWithUTF8String:"width"]];
  [values release];
  [options release];
  id<MTLDevice> system_device = MTLCreateSystemDefaultDevice();
  [system_device release];
}
