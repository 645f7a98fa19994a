// This process's rank in MPI_COMM_WORLD and the world's size, for the tests that run under mpirun
// (tests/mpi_main.cpp initialises MPI for every test binary).
#pragma once

#include <mpi.h>

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
