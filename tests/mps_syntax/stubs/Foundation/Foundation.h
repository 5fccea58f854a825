// Foundation, as much as flash_metal's .mm and PyTorch's MPS headers use.
// Syntax-check stub (tests/mps/test_mps_host.py), never compiled into anything.
// Transcribed from Apple's documentation; one link per declaration.
// Nullability and availability annotations are omitted: they do not change
// which calls type-check.
#pragma once

#include <Availability.h>  // the SDK version macros (stubs/Availability.h)
#include <stddef.h>

// https://developer.apple.com/documentation/objectivec/nsuinteger?language=objc (64-bit)
typedef unsigned long NSUInteger;
// https://developer.apple.com/documentation/objectivec/nsinteger?language=objc (64-bit)
typedef long NSInteger;
// https://developer.apple.com/documentation/objectivec/bool?language=objc (arm64: bool)
typedef bool BOOL;
// https://developer.apple.com/documentation/objectivec/yes?language=objc
#define YES __objc_yes
// https://developer.apple.com/documentation/objectivec/no?language=objc
#define NO __objc_no
// https://developer.apple.com/documentation/objectivec/nil?language=objc
#ifndef nil
#define nil nullptr
#endif

@class NSString;

// https://developer.apple.com/documentation/objectivec/1418956-nsobject?language=objc (the protocol)
@protocol NSObject
// https://developer.apple.com/documentation/objectivec/1571946-retain?language=objc
- (instancetype)retain;
// https://developer.apple.com/documentation/objectivec/1571957-release?language=objc
- (oneway void)release;
// https://developer.apple.com/documentation/objectivec/1571951-autorelease?language=objc
- (instancetype)autorelease;
// https://developer.apple.com/documentation/objectivec/1571952-retaincount?language=objc
// (PyTorch 2.4's MPSProfiler.h prints it)
- (NSUInteger)retainCount;
@end

// https://developer.apple.com/documentation/objectivec/nsobject?language=objc (the root class)
__attribute__((objc_root_class))
@interface NSObject <NSObject>
// https://developer.apple.com/documentation/objectivec/nsobject/1571958-alloc?language=objc
+ (instancetype)alloc;
// https://developer.apple.com/documentation/objectivec/nsobject/1418641-init?language=objc
- (instancetype)init;
@end

// https://developer.apple.com/documentation/foundation/nsstring?language=objc
@interface NSString : NSObject
// https://developer.apple.com/documentation/foundation/nsstring/1497379-stringwithutf8string?language=objc
+ (instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
// https://developer.apple.com/documentation/foundation/nsstring/1411189-utf8string?language=objc
@property(readonly) const char* UTF8String;
@end

// https://developer.apple.com/documentation/foundation/nsurl?language=objc
@interface NSURL : NSObject
// https://developer.apple.com/documentation/foundation/nsurl/1410828-fileurlwithpath?language=objc
+ (NSURL*)fileURLWithPath:(NSString*)path;
@end

// https://developer.apple.com/documentation/foundation/nserror?language=objc
@interface NSError : NSObject
// https://developer.apple.com/documentation/foundation/nserror/1414418-localizeddescription?language=objc
@property(readonly, copy) NSString* localizedDescription;
@end

// https://developer.apple.com/documentation/foundation/nsdictionary?language=objc
// (used only as a type by PyTorch's MPSStream.h and MTLCompileOptions)
@interface NSDictionary : NSObject
@end

// https://developer.apple.com/documentation/foundation/nsrange?language=objc
typedef struct _NSRange {
  NSUInteger location;
  NSUInteger length;
} NSRange;

// https://developer.apple.com/documentation/foundation/1417188-nsmakerange?language=objc
static inline NSRange NSMakeRange(NSUInteger loc, NSUInteger len) {
  NSRange r = {loc, len};
  return r;
}

// https://developer.apple.com/documentation/foundation/nsarray?language=objc
@interface NSArray<__covariant ObjectType> : NSObject
// https://developer.apple.com/documentation/foundation/nsarray/1409982-count?language=objc
@property(readonly) NSUInteger count;
// https://developer.apple.com/documentation/foundation/nsarray/1417555-objectatindex?language=objc
- (ObjectType)objectAtIndex:(NSUInteger)index;
@end

// https://developer.apple.com/documentation/foundation/nsoperatingsystemversion?language=objc
typedef struct {
  NSInteger majorVersion;
  NSInteger minorVersion;
  NSInteger patchVersion;
} NSOperatingSystemVersion;

// https://developer.apple.com/documentation/foundation/nsprocessinfo?language=objc
@interface NSProcessInfo : NSObject
// https://developer.apple.com/documentation/foundation/nsprocessinfo/processinfo?language=objc
@property(class, readonly) NSProcessInfo* processInfo;
// https://developer.apple.com/documentation/foundation/nsprocessinfo/operatingsystemversion?language=objc
@property(readonly) NSOperatingSystemVersion operatingSystemVersion;
@end

#include <dispatch/dispatch.h>
