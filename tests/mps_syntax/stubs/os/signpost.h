// os_signpost, as much as PyTorch's MPSProfiler.h names.
// Syntax-check stub (tests/mps/test_mps_host.py), never compiled into anything.
#pragma once

#include <os/log.h>
#include <stdint.h>

// https://developer.apple.com/documentation/os/os_signpost_id_t?language=objc
typedef uint64_t os_signpost_id_t;

// https://developer.apple.com/documentation/os/os_signpost_type_t?language=objc
typedef enum : uint8_t {
  OS_SIGNPOST_EVENT = 0x00,
  OS_SIGNPOST_INTERVAL_BEGIN = 0x01,
  OS_SIGNPOST_INTERVAL_END = 0x02,
} os_signpost_type_t;
