// Stand-in for the header a CUDA build of libtorch generates (Debian's CPU libtorch ships the
// c10/cuda headers without it). Used only by the mpitrain_gpu_compile_check target, which
// compiles the GPU sources on CPU machines and is never linked.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
