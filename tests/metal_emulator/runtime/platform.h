// Included first by every runtime source, before any system header: the
// feature macros must be set before the C library's headers are read.
#pragma once
#if defined(__APPLE__)
// macOS declares the ucontext functions (getcontext, makecontext,
// swapcontext: the fiber switch off x86-64 Linux) only under _XOPEN_SOURCE,
// which on its own hides the BSD names the runtime also uses (MAP_ANONYMOUS,
// MAP_NORESERVE, dladdr); _DARWIN_C_SOURCE brings them back.
#ifndef _XOPEN_SOURCE
#define _XOPEN_SOURCE 700
#endif
#ifndef _DARWIN_C_SOURCE
#define _DARWIN_C_SOURCE
#endif
// Apple marks the ucontext functions deprecated; they still work, and the
// emulator needs nothing else from them.
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
#endif
