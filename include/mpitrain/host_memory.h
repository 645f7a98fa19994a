// libtorch's CPU allocations counted (issue 41: a training run's peak memory on the CPU against
// what `mpitrain plan` predicts). A process's resident size mixes libtorch, MPI, HDF5 and glibc's
// retained free blocks (keep_freed_memory); the tensors alone are what plan counts. Once
// installed, every CPU tensor libtorch allocates goes through a counter that wraps the allocator
// it replaced (the same memory, one mutex-guarded map entry per live allocation), so a CPU run
// can report its peak as a GPU run reports its caching allocator's.
#pragma once

#include <cstdint>

namespace mpitrain {

// Installs the counter as libtorch's CPU allocator (idempotent, thread-safe). Tensors allocated
// before are freed through their own allocator and never counted.
void count_cpu_allocations();
bool cpu_allocations_counted();

// Bytes of CPU tensors allocated through the counter and not yet freed; the most there were
// since installation or the last reset_cpu_peak(). 0 when not installed.
int64_t cpu_allocated_bytes();
int64_t cpu_peak_allocated_bytes();
void reset_cpu_peak();  // the peak becomes the bytes in use now

}  // namespace mpitrain
