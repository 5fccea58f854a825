// The smallest extension that shows issue 39's crash: one op whose error
// message formats an integer (TORCH_CHECK_VALUE's c10::str, through
// std::ostream << long). Built with a private static libstdc++ beside the
// process's libstdc++.so.6 (what a GCC without its shared runtime does), the
// number is formatted by a C++ runtime whose locale state was never set up:
// on an AMX Xeon (Ubuntu 24.04, gcc 13.3) that was a SIGSEGV; on Debian 12
// (gcc 12.2) the number silently vanishes from the message. Built by
// tests/project/test_build_runtime.py; not part of the package.
#include <ATen/core/Tensor.h>
#include <Python.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#ifndef PROBE_NS
#error "PROBE_NS must name the op namespace (one per build)"
#endif

namespace {
at::Tensor throw_value(const at::Tensor& x) {
  TORCH_CHECK_VALUE(false, "probe: x has ", x.dim(), " dimensions and ", x.numel(), " elements");
  return x;
}
}  // namespace

TORCH_LIBRARY(PROBE_NS, m) { m.def("throw_value(Tensor x) -> Tensor", &throw_value); }

#define FM_CAT2(a, b) a##b
#define FM_CAT(a, b) FM_CAT2(a, b)
#define FM_STR2(a) #a
#define FM_STR(a) FM_STR2(a)
static struct PyModuleDef fm_module = {PyModuleDef_HEAD_INIT, FM_STR(PROBE_NS), nullptr, -1, nullptr};
PyMODINIT_FUNC FM_CAT(PyInit_, PROBE_NS)(void) { return PyModule_Create(&fm_module); }
