// libdispatch, as much as flash_metal's .mm and PyTorch's MPS headers use.
// Syntax-check stub (tests/mps/test_mps_host.py), never compiled into anything.
// Transcribed from Apple's documentation; one link per declaration.
#pragma once

#include <stddef.h>

#ifdef __OBJC__
// https://developer.apple.com/documentation/dispatch/dispatch_object_t?language=objc
// (with Objective-C, dispatch objects are Objective-C objects conforming to OS_dispatch_* protocols)
@protocol OS_dispatch_object <NSObject>
@end
@protocol OS_dispatch_queue <OS_dispatch_object>
@end
// https://developer.apple.com/documentation/dispatch/dispatch_queue_t?language=objc
typedef NSObject<OS_dispatch_queue>* dispatch_queue_t;
@protocol OS_dispatch_queue_global <OS_dispatch_queue>
@end
// https://developer.apple.com/documentation/dispatch/dispatch_queue_global_t?language=objc
typedef NSObject<OS_dispatch_queue_global>* dispatch_queue_global_t;
#else
typedef struct dispatch_queue_s* dispatch_queue_t;
typedef struct dispatch_queue_s* dispatch_queue_global_t;
#endif

// https://developer.apple.com/documentation/dispatch/dispatch_block_t?language=objc
typedef void (^dispatch_block_t)(void);

// https://developer.apple.com/documentation/dispatch/1452870-dispatch_sync?language=objc
extern "C" void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);

// https://developer.apple.com/documentation/dispatch/1453050-dispatch_apply?language=objc
// (the man page dispatch_apply(3) gives the same declaration)
extern "C" void dispatch_apply(size_t iterations, dispatch_queue_t queue, void (^block)(size_t iteration));

// https://developer.apple.com/documentation/dispatch/1452927-dispatch_get_global_queue?language=objc
extern "C" dispatch_queue_global_t dispatch_get_global_queue(long identifier, unsigned long flags);

// https://developer.apple.com/documentation/dispatch/dispatch_queue_priority_default?language=objc
#define DISPATCH_QUEUE_PRIORITY_DEFAULT 0
