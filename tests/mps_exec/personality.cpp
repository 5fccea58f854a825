// Lets C++ exceptions cross the Objective-C++ frames of the execution test.
//
// Under -fobjc-runtime=gcc, clang gives every Objective-C++ function GCC's
// Objective-C personality routine, __gnu_objc_personality_v0, which runs
// cleanups for a C++ exception but never matches a C++ catch clause (it only
// knows Objective-C exceptions). Apple's runtime uses a personality that
// defers to C++'s, so on a Mac `catch (const std::exception&)` in a .mm
// works. Defining the symbol here, in the test library, so that it forwards
// to the C++ personality gives the same behaviour (the test never throws an
// Objective-C exception, the only thing this would lose). The LSDA format is
// the same for both routines. Never shipped.
#include <unwind.h>

extern "C" _Unwind_Reason_Code __gxx_personality_v0(int version, _Unwind_Action actions,
                                                    _Unwind_Exception_Class exception_class,
                                                    _Unwind_Exception* exception, _Unwind_Context* context);

extern "C" _Unwind_Reason_Code __gnu_objc_personality_v0(int version, _Unwind_Action actions,
                                                         _Unwind_Exception_Class exception_class,
                                                         _Unwind_Exception* exception, _Unwind_Context* context) {
  return __gxx_personality_v0(version, actions, exception_class, exception, context);
}
