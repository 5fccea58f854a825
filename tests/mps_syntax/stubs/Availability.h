// The SDK version macros of Apple's <Availability.h> (its AvailabilityVersions.h),
// which is how source tells at compile time which SDK it is built against: an
// SDK defines __MAC_X_Y for every macOS release up to its own and no later one
// (PyTorch's MPSGraphSequoiaOps.h tests __MAC_15_0 the same way).
// Syntax-check stub, never compiled into anything.
//
// FM_STUB_MACOS_SDK picks the SDK these stubs stand for, as 10000 * major +
// 100 * minor; the stubs leave out every declaration that SDK lacks.
//   -DFM_STUB_MACOS_SDK=140000  Xcode 15 / Command Line Tools 15 (the oldest
//                               toolchain that builds Metal 3.1): no macOS 15
//                               API such as MTLMathMode.
//   default 260000              Xcode 26, the newest: everything transcribed.
// tests/mps/test_mps_host.py and tests/mps/test_mps_exec.py build against both.
#pragma once

#ifndef FM_STUB_MACOS_SDK
#define FM_STUB_MACOS_SDK 260000
#endif

// https://developer.apple.com/documentation/xcode/running-code-on-a-specific-version (the __MAC_* constants)
#define __MAC_13_0 130000
#define __MAC_14_0 140000
#if FM_STUB_MACOS_SDK >= 150000
#define __MAC_15_0 150000
#endif
#if FM_STUB_MACOS_SDK >= 260000
#define __MAC_26_0 260000
#endif
