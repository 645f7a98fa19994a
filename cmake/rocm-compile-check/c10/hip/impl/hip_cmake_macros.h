// Stand-in for the header a ROCm build of libtorch generates (c10/hip/HIPMacros.h includes it),
// as cmake/gpu-compile-check/ has for CUDA. Used only by mpitrain_rocm_compile_check, which is
// never linked.
#pragma once
#define C10_HIP_BUILD_SHARED_LIBS
