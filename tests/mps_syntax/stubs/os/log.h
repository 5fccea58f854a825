// os_log, as much as PyTorch's MPSProfiler.h names.
// Syntax-check stub (tests/mps/test_mps_host.py), never compiled into anything.
#pragma once

#ifdef __OBJC__
// https://developer.apple.com/documentation/os/os_log_t?language=objc
// (an Objective-C object conforming to OS_os_log under Objective-C)
@protocol OS_os_log <NSObject>
@end
typedef NSObject<OS_os_log>* os_log_t;
#else
typedef struct os_log_s* os_log_t;
#endif
