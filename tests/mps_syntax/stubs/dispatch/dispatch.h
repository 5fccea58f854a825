// libdispatch, as much as flash_metal's .mm and PyTorch's MPS headers use.
// Syntax-check stub (tests/test_mps_host.py), never compiled into anything.
// Transcribed from Apple's documentation; one link per declaration.
#pragma once

#ifdef __OBJC__
// https://developer.apple.com/documentation/dispatch/dispatch_object_t?language=objc
// (with Objective-C, dispatch objects are Objective-C objects conforming to OS_dispatch_* protocols)
@protocol OS_dispatch_object <NSObject>
@end
@protocol OS_dispatch_queue <OS_dispatch_object>
@end
// https://developer.apple.com/documentation/dispatch/dispatch_queue_t?language=objc
typedef NSObject<OS_dispatch_queue>* dispatch_queue_t;
#else
typedef struct dispatch_queue_s* dispatch_queue_t;
#endif

// https://developer.apple.com/documentation/dispatch/dispatch_block_t?language=objc
typedef void (^dispatch_block_t)(void);

// https://developer.apple.com/documentation/dispatch/1452870-dispatch_sync?language=objc
extern "C" void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);
