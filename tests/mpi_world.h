// This process's rank in MPI_COMM_WORLD and the world's size, for the tests that run under mpirun
// (tests/mpi_main.cpp initialises MPI for every test binary). Through mpi_ops.h: no <mpi.h>.
#pragma once

#include "mpitrain/mpi_ops.h"

inline int world_rank() { return mpitrain::mpi::rank(mpitrain::mpi::world()); }

inline int world_size() { return mpitrain::mpi::size(mpitrain::mpi::world()); }
