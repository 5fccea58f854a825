// Metal, as much as flash_metal's .mm and PyTorch's MPS headers use.
// Syntax-check stub (tests/test_mps_host.py), never compiled into anything.
// Transcribed from Apple's documentation; one link per declaration. Each
// selector must match Apple's exactly: the check compiles with
// -Werror=objc-method-access, so a call to an undeclared selector fails.
// Nullability, availability and __autoreleasing annotations are omitted.
#pragma once

#include <Foundation/Foundation.h>

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
  // https://developer.apple.com/documentation/metal/mtldatatype/bool?language=objc
  MTLDataTypeBool = 53,
} MTLDataType;

// https://developer.apple.com/documentation/metal/mtllanguageversion?language=objc
typedef enum : NSUInteger {
  // https://developer.apple.com/documentation/metal/mtllanguageversion/version3_1?language=objc
  MTLLanguageVersion3_1 = (3 << 16) + 1,
} MTLLanguageVersion;

// https://developer.apple.com/documentation/metal/mtlresource?language=objc
@protocol MTLResource <NSObject>
@end

// https://developer.apple.com/documentation/metal/mtlbuffer?language=objc
@protocol MTLBuffer <MTLResource>
@end

// https://developer.apple.com/documentation/metal/mtlfunction?language=objc
@protocol MTLFunction <NSObject>
@end

// https://developer.apple.com/documentation/metal/mtlcompileoptions?language=objc
@interface MTLCompileOptions : NSObject
// https://developer.apple.com/documentation/metal/mtlcompileoptions/languageversion?language=objc
@property(readwrite, nonatomic) MTLLanguageVersion languageVersion;
@end

// https://developer.apple.com/documentation/metal/mtlfunctionconstantvalues?language=objc
@interface MTLFunctionConstantValues : NSObject
// https://developer.apple.com/documentation/metal/mtlfunctionconstantvalues/setconstantvalue(_:type:index:)?language=objc
- (void)setConstantValue:(const void*)value type:(MTLDataType)type atIndex:(NSUInteger)index;
@end

// https://developer.apple.com/documentation/metal/mtllibrary?language=objc
@protocol MTLLibrary <NSObject>
// https://developer.apple.com/documentation/metal/mtllibrary/makefunction(name:constantvalues:)?language=objc
- (id<MTLFunction>)newFunctionWithName:(NSString*)name
                        constantValues:(MTLFunctionConstantValues*)constantValues
                                 error:(NSError**)error;
@end

// https://developer.apple.com/documentation/metal/mtlcomputepipelinestate?language=objc
@protocol MTLComputePipelineState <NSObject>
// https://developer.apple.com/documentation/metal/mtlcomputepipelinestate/maxtotalthreadsperthreadgroup?language=objc
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
// https://developer.apple.com/documentation/metal/mtlcomputepipelinestate/staticthreadgroupmemorylength?language=objc
@property(readonly) NSUInteger staticThreadgroupMemoryLength;
@end

// https://developer.apple.com/documentation/metal/mtldevice?language=objc
@protocol MTLDevice <NSObject>
// https://developer.apple.com/documentation/metal/mtldevice/makelibrary(url:)?language=objc
- (id<MTLLibrary>)newLibraryWithURL:(NSURL*)url error:(NSError**)error;
// https://developer.apple.com/documentation/metal/mtldevice/makelibrary(source:options:)?language=objc
- (id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                               options:(MTLCompileOptions*)options
                                 error:(NSError**)error;
// https://developer.apple.com/documentation/metal/mtldevice/makecomputepipelinestate(function:)?language=objc
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                             error:(NSError**)error;
// https://developer.apple.com/documentation/metal/mtldevice/maxthreadgroupmemorylength?language=objc
@property(readonly) NSUInteger maxThreadgroupMemoryLength;
@end

// https://developer.apple.com/documentation/metal/mtlcommandencoder?language=objc
@protocol MTLCommandEncoder <NSObject>
@end

// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder?language=objc
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setcomputepipelinestate(_:)?language=objc
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setbuffer(_:offset:index:)?language=objc
- (void)setBuffer:(id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setbytes(_:length:index:)?language=objc
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setthreadgroupmemorylength(_:index:)?language=objc
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/dispatchthreadgroups(_:threadsperthreadgroup:)?language=objc
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end

// Types PyTorch's MPSStream.h names; flash_metal sends them no message.
// https://developer.apple.com/documentation/metal/mtlcommandqueue?language=objc
@protocol MTLCommandQueue <NSObject>
@end
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
