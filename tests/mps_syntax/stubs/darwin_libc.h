// Darwin's C library, as much of it as PyTorch's MPS headers use beyond
// POSIX (they include Linux's own libc headers here). syntax_check.py
// force-includes this file (-include), since it cannot replace <time.h>.
// Syntax-check stub, never compiled into anything.
#pragma once

#include <stdint.h>
#include <time.h>

// https://developer.apple.com/library/archive/documentation/System/Conceptual/ManPages_iPhoneOS/man3/clock_gettime_nsec_np.3.html
// (MPSProfiler.h's timestamps)
extern "C" uint64_t clock_gettime_nsec_np(clockid_t clock_id);
