// Metal: what flash_metal's .mm and PyTorch's MPS headers (2.4 to 2.14) use,
// plus the neighbouring real API a correct future change may call, so that
// a correct call never fails the check (tests/mps/test_mps_host.py proves a
// sample of them parses).
// Syntax-check stub, never compiled into anything. Transcribed from Apple's
// documentation; one link per declaration. Each selector must match Apple's
// exactly: the check compiles with -Werror=objc-method-access, so a call to
// an undeclared selector fails. Nullability and __autoreleasing annotations
// are omitted (they do not change which calls type-check). NS_OPTIONS types
// are declared as Apple's macro expands them in C++ (a typedef of the
// integer plus an enum of the flags), so that `A | B` type-checks. Availability is
// kept, as Apple writes it, where flash_metal depends on it: clang ignores
// macOS availability on Linux, so tests/mps/test_mps_host.py checks the guards
// textually, and on a Mac library.mm turns unguarded use into an error
// (#pragma clang diagnostic error "-Wunguarded-availability-new").
// What an SDK lacks is left out for the SDK view FM_STUB_MACOS_SDK selects
// (stubs/Availability.h): `@available` guards the run time only, so code that
// names macOS 15 API must also compile with Xcode 15's SDK, where it does not exist.
#pragma once

#include <Foundation/Foundation.h>
#include <stdint.h>

#define FM_STUB_MACOS(version) __attribute__((availability(macos, introduced = version)))
#define FM_STUB_MACOS_DEPRECATED(introduced_in, deprecated_in) \
  __attribute__((availability(macos, introduced = introduced_in, deprecated = deprecated_in)))

@protocol MTLDevice;

// https://developer.apple.com/documentation/metal/mtlsize?language=objc
typedef struct {
  NSUInteger width;
  NSUInteger height;
  NSUInteger depth;
} MTLSize;

// https://developer.apple.com/documentation/metal/mtlsizemake(_:_:_:)?language=objc
static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize size = {width, height, depth};
  return size;
}

// https://developer.apple.com/documentation/metal/mtldatatype?language=objc
typedef enum : NSUInteger {
  // https://developer.apple.com/documentation/metal/mtldatatype/float?language=objc
  MTLDataTypeFloat = 3,
  // https://developer.apple.com/documentation/metal/mtldatatype/int?language=objc
  MTLDataTypeInt = 29,
  // https://developer.apple.com/documentation/metal/mtldatatype/uint?language=objc
  MTLDataTypeUInt = 33,
  // https://developer.apple.com/documentation/metal/mtldatatype/bool?language=objc
  MTLDataTypeBool = 53,
} MTLDataType;

// https://developer.apple.com/documentation/metal/mtllanguageversion?language=objc
typedef enum : NSUInteger {
  // https://developer.apple.com/documentation/metal/mtllanguageversion/version3_0?language=objc
  MTLLanguageVersion3_0 FM_STUB_MACOS(13.0) = (3 << 16) + 0,
  // https://developer.apple.com/documentation/metal/mtllanguageversion/version3_1?language=objc
  MTLLanguageVersion3_1 FM_STUB_MACOS(14.0) = (3 << 16) + 1,
#if defined(__MAC_15_0)  // the macOS 15 SDK (Xcode 16) and later
  // https://developer.apple.com/documentation/metal/mtllanguageversion/version3_2?language=objc
  MTLLanguageVersion3_2 FM_STUB_MACOS(15.0) = (3 << 16) + 2,
#endif
} MTLLanguageVersion;

#if defined(__MAC_15_0)  // the macOS 15 SDK (Xcode 16) and later: absent from Xcode 15's SDK
// https://developer.apple.com/documentation/metal/mtlmathmode?language=objc
typedef enum : NSInteger {
  // https://developer.apple.com/documentation/metal/mtlmathmode/safe?language=objc
  MTLMathModeSafe = 0,
  // https://developer.apple.com/documentation/metal/mtlmathmode/relaxed?language=objc
  MTLMathModeRelaxed = 1,
  // https://developer.apple.com/documentation/metal/mtlmathmode/fast?language=objc
  MTLMathModeFast = 2,
} MTLMathMode FM_STUB_MACOS(15.0);

// https://developer.apple.com/documentation/metal/mtlmathfloatingpointfunctions?language=objc
typedef enum : NSInteger {
  // https://developer.apple.com/documentation/metal/mtlmathfloatingpointfunctions/fast?language=objc
  MTLMathFloatingPointFunctionsFast = 0,
  // https://developer.apple.com/documentation/metal/mtlmathfloatingpointfunctions/precise?language=objc
  MTLMathFloatingPointFunctionsPrecise = 1,
} MTLMathFloatingPointFunctions FM_STUB_MACOS(15.0);
#endif

// https://developer.apple.com/documentation/metal/mtlgpufamily?language=objc
typedef enum : NSInteger {
  // https://developer.apple.com/documentation/metal/mtlgpufamily/apple7?language=objc
  MTLGPUFamilyApple7 = 1007,
  // https://developer.apple.com/documentation/metal/mtlgpufamily/apple8?language=objc
  MTLGPUFamilyApple8 = 1008,
  // https://developer.apple.com/documentation/metal/mtlgpufamily/apple9?language=objc
  MTLGPUFamilyApple9 = 1009,
  // https://developer.apple.com/documentation/metal/mtlgpufamily/mac2?language=objc
  MTLGPUFamilyMac2 = 2002,
  // https://developer.apple.com/documentation/metal/mtlgpufamily/metal3?language=objc
  MTLGPUFamilyMetal3 = 5001,
} MTLGPUFamily;

// https://developer.apple.com/documentation/metal/mtlresourceoptions?language=objc
typedef NSUInteger MTLResourceOptions;
enum : NSUInteger {
  // https://developer.apple.com/documentation/metal/mtlresourceoptions/storagemodeshared?language=objc
  MTLResourceStorageModeShared = 0 << 4,
  // https://developer.apple.com/documentation/metal/mtlresourceoptions/storagemodeprivate?language=objc
  MTLResourceStorageModePrivate = 2 << 4,
};

// https://developer.apple.com/documentation/metal/mtlbarrierscope?language=objc
typedef NSUInteger MTLBarrierScope;
enum : NSUInteger {
  // https://developer.apple.com/documentation/metal/mtlbarrierscope/buffers?language=objc
  MTLBarrierScopeBuffers = 1 << 0,
};

// https://developer.apple.com/documentation/metal/mtlresourceusage?language=objc
typedef NSUInteger MTLResourceUsage;
enum : NSUInteger {
  // https://developer.apple.com/documentation/metal/mtlresourceusage/read?language=objc
  MTLResourceUsageRead = 1 << 0,
  // https://developer.apple.com/documentation/metal/mtlresourceusage/write?language=objc
  MTLResourceUsageWrite = 1 << 1,
};

// https://developer.apple.com/documentation/metal/mtlresource?language=objc
@protocol MTLResource <NSObject>
// https://developer.apple.com/documentation/metal/mtlresource/label?language=objc
@property(copy, atomic) NSString* label;
// https://developer.apple.com/documentation/metal/mtlresource/device?language=objc
@property(readonly) id<MTLDevice> device;
@end

// https://developer.apple.com/documentation/metal/mtlbuffer?language=objc
@protocol MTLBuffer <MTLResource>
// https://developer.apple.com/documentation/metal/mtlbuffer/contents()?language=objc
- (void*)contents;
// https://developer.apple.com/documentation/metal/mtlbuffer/length?language=objc
@property(readonly) NSUInteger length;
@end

// https://developer.apple.com/documentation/metal/mtlfunction?language=objc
@protocol MTLFunction <NSObject>
// https://developer.apple.com/documentation/metal/mtlfunction/name?language=objc
@property(readonly) NSString* name;
// https://developer.apple.com/documentation/metal/mtlfunction/device?language=objc
@property(readonly) id<MTLDevice> device;
@end

// https://developer.apple.com/documentation/metal/mtlcompileoptions?language=objc
@interface MTLCompileOptions : NSObject
// https://developer.apple.com/documentation/metal/mtlcompileoptions/languageversion?language=objc
@property(readwrite, nonatomic) MTLLanguageVersion languageVersion;
// https://developer.apple.com/documentation/metal/mtlcompileoptions/fastmathenabled?language=objc
// (deprecated in macOS 15 for mathMode)
@property(readwrite, nonatomic) BOOL fastMathEnabled FM_STUB_MACOS_DEPRECATED(10.11, 15.0);
#if defined(__MAC_15_0)  // the macOS 15 SDK (Xcode 16) and later
// https://developer.apple.com/documentation/metal/mtlcompileoptions/mathmode?language=objc
@property(readwrite, nonatomic) MTLMathMode mathMode FM_STUB_MACOS(15.0);
// https://developer.apple.com/documentation/metal/mtlcompileoptions/mathfloatingpointfunctions?language=objc
@property(readwrite, nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions FM_STUB_MACOS(15.0);
#endif
// https://developer.apple.com/documentation/metal/mtlcompileoptions/preprocessormacros?language=objc
@property(readwrite, copy, nonatomic) NSDictionary* preprocessorMacros;
@end

// https://developer.apple.com/documentation/metal/mtlfunctionconstantvalues?language=objc
@interface MTLFunctionConstantValues : NSObject
// https://developer.apple.com/documentation/metal/mtlfunctionconstantvalues/setconstantvalue(_:type:index:)?language=objc
- (void)setConstantValue:(const void*)value type:(MTLDataType)type atIndex:(NSUInteger)index;
// https://developer.apple.com/documentation/metal/mtlfunctionconstantvalues/setconstantvalue(_:type:withname:)?language=objc
- (void)setConstantValue:(const void*)value type:(MTLDataType)type withName:(NSString*)name;
// https://developer.apple.com/documentation/metal/mtlfunctionconstantvalues/setconstantvalues(_:type:range:)?language=objc
- (void)setConstantValues:(const void*)values type:(MTLDataType)type withRange:(NSRange)range;
@end

// https://developer.apple.com/documentation/metal/mtllibrary?language=objc
@protocol MTLLibrary <NSObject>
// https://developer.apple.com/documentation/metal/mtllibrary/makefunction(name:)?language=objc
- (id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
// https://developer.apple.com/documentation/metal/mtllibrary/makefunction(name:constantvalues:)?language=objc
- (id<MTLFunction>)newFunctionWithName:(NSString*)name
                        constantValues:(MTLFunctionConstantValues*)constantValues
                                 error:(NSError**)error;
// https://developer.apple.com/documentation/metal/mtllibrary/functionnames?language=objc
@property(readonly) NSArray<NSString*>* functionNames;
// https://developer.apple.com/documentation/metal/mtllibrary/label?language=objc
@property(copy, atomic) NSString* label;
@end

// https://developer.apple.com/documentation/metal/mtlcomputepipelinestate?language=objc
@protocol MTLComputePipelineState <NSObject>
// https://developer.apple.com/documentation/metal/mtlcomputepipelinestate/maxtotalthreadsperthreadgroup?language=objc
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
// https://developer.apple.com/documentation/metal/mtlcomputepipelinestate/threadexecutionwidth?language=objc
@property(readonly) NSUInteger threadExecutionWidth;
// https://developer.apple.com/documentation/metal/mtlcomputepipelinestate/staticthreadgroupmemorylength?language=objc
@property(readonly) NSUInteger staticThreadgroupMemoryLength;
// https://developer.apple.com/documentation/metal/mtlcomputepipelinestate/label?language=objc
@property(readonly) NSString* label;
// https://developer.apple.com/documentation/metal/mtlcomputepipelinestate/device?language=objc
@property(readonly) id<MTLDevice> device;
@end

// https://developer.apple.com/documentation/metal/mtlcommandqueue?language=objc
@protocol MTLCommandQueue <NSObject>
// https://developer.apple.com/documentation/metal/mtlcommandqueue/device?language=objc
// (PyTorch 2.4's MPSStream::device() sends it)
@property(readonly) id<MTLDevice> device;
// https://developer.apple.com/documentation/metal/mtlcommandqueue/label?language=objc
@property(copy, atomic) NSString* label;
@end

// https://developer.apple.com/documentation/metal/mtldevice?language=objc
@protocol MTLDevice <NSObject>
// https://developer.apple.com/documentation/metal/mtldevice/name?language=objc
@property(readonly) NSString* name;
// https://developer.apple.com/documentation/metal/mtldevice/registryid?language=objc
@property(readonly) uint64_t registryID FM_STUB_MACOS(10.13);
// https://developer.apple.com/documentation/metal/mtldevice/maxthreadsperthreadgroup?language=objc
@property(readonly) MTLSize maxThreadsPerThreadgroup;
// https://developer.apple.com/documentation/metal/mtldevice/maxthreadgroupmemorylength?language=objc
@property(readonly) NSUInteger maxThreadgroupMemoryLength;
// https://developer.apple.com/documentation/metal/mtldevice/hasunifiedmemory?language=objc
@property(readonly) BOOL hasUnifiedMemory;
// https://developer.apple.com/documentation/metal/mtldevice/supportsfamily(_:)?language=objc
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily;
// https://developer.apple.com/documentation/metal/mtldevice/makecommandqueue()?language=objc
- (id<MTLCommandQueue>)newCommandQueue;
// https://developer.apple.com/documentation/metal/mtldevice/makebuffer(length:options:)?language=objc
- (id<MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options;
// https://developer.apple.com/documentation/metal/mtldevice/makelibrary(url:)?language=objc
- (id<MTLLibrary>)newLibraryWithURL:(NSURL*)url error:(NSError**)error;
// https://developer.apple.com/documentation/metal/mtldevice/makelibrary(source:options:)?language=objc
- (id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                               options:(MTLCompileOptions*)options
                                 error:(NSError**)error;
// https://developer.apple.com/documentation/metal/mtldevice/makecomputepipelinestate(function:)?language=objc
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                             error:(NSError**)error;
@end

// https://developer.apple.com/documentation/metal/mtlcreatesystemdefaultdevice()?language=objc
extern "C" id<MTLDevice> MTLCreateSystemDefaultDevice(void);
// https://developer.apple.com/documentation/metal/mtlcopyalldevices()?language=objc
// (the Create rule: the caller owns the returned array)
extern "C" NSArray<id<MTLDevice>>* MTLCopyAllDevices(void) FM_STUB_MACOS(10.11);

// https://developer.apple.com/documentation/metal/mtlcommandencoder?language=objc
@protocol MTLCommandEncoder <NSObject>
// https://developer.apple.com/documentation/metal/mtlcommandencoder/device?language=objc
@property(readonly) id<MTLDevice> device;
// https://developer.apple.com/documentation/metal/mtlcommandencoder/label?language=objc
@property(copy, atomic) NSString* label;
// https://developer.apple.com/documentation/metal/mtlcommandencoder/endencoding()?language=objc
// (flash_metal never ends PyTorch's shared encoder: tests/mps/test_mps_host.py bans it)
- (void)endEncoding;
// https://developer.apple.com/documentation/metal/mtlcommandencoder/pushdebuggroup(_:)?language=objc
- (void)pushDebugGroup:(NSString*)string;
// https://developer.apple.com/documentation/metal/mtlcommandencoder/popdebuggroup()?language=objc
- (void)popDebugGroup;
// https://developer.apple.com/documentation/metal/mtlcommandencoder/insertdebugsignpost(_:)?language=objc
- (void)insertDebugSignpost:(NSString*)string;
@end

// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder?language=objc
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setcomputepipelinestate(_:)?language=objc
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setbuffer(_:offset:index:)?language=objc
- (void)setBuffer:(id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setbufferoffset(_:index:)?language=objc
- (void)setBufferOffset:(NSUInteger)offset atIndex:(NSUInteger)index;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setbuffers(_:offsets:range:)?language=objc
- (void)setBuffers:(const id<MTLBuffer>[])buffers offsets:(const NSUInteger[])offsets withRange:(NSRange)range;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setbytes(_:length:index:)?language=objc
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setthreadgroupmemorylength(_:index:)?language=objc
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/dispatchthreadgroups(_:threadsperthreadgroup:)?language=objc
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/dispatchthreads(_:threadsperthreadgroup:)?language=objc
- (void)dispatchThreads:(MTLSize)threadsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/memorybarrier(scope:)?language=objc
- (void)memoryBarrierWithScope:(MTLBarrierScope)scope;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/useresource(_:usage:)?language=objc
- (void)useResource:(id<MTLResource>)resource usage:(MTLResourceUsage)usage;
@end

// Types PyTorch's MPS headers name; flash_metal sends them no message.
// https://developer.apple.com/documentation/metal/mtlcommandbuffer?language=objc
@protocol MTLCommandBuffer <NSObject>
@end
// https://developer.apple.com/documentation/metal/mtlevent?language=objc
@protocol MTLEvent <NSObject>
@end
// https://developer.apple.com/documentation/metal/mtlsharedevent?language=objc
@protocol MTLSharedEvent <MTLEvent>
@end
// https://developer.apple.com/documentation/metal/mtlcommandbufferhandler?language=objc
typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);
// https://developer.apple.com/documentation/metal/mtlcapturemanager?language=objc
// (PyTorch's MPSProfiler.h keeps a pointer to one)
@interface MTLCaptureManager : NSObject
@end
