// For the MPI room's sources only (src/comm/, src/launch/, src/data/pack*.cpp, the tests' and
// benchmarks' MPI parts): <mpi.h> and the conversions between its MPI_Comm and mpitrain::MpiComm
// (mpi_ops.h). No other header includes <mpi.h>, and the libraries outside the room are compiled
// without MPI's include directories, so a use of MPI there fails to compile.
#pragma once

#include <mpi.h>

#include <cstdint>

#include "mpitrain/mpi_ops.h"

namespace mpitrain {

// A C cast: a reinterpret_cast for Open MPI's pointer, a static_cast for MPICH's int.
inline MPI_Comm to_mpi(MpiComm comm) {
  return comm == MpiComm{} ? MPI_COMM_NULL : (MPI_Comm)static_cast<std::intptr_t>(comm);  // NOLINT
}

inline MpiComm from_mpi(MPI_Comm comm) {
  return comm == MPI_COMM_NULL ? MpiComm{} : static_cast<MpiComm>((std::intptr_t)comm);  // NOLINT
}

}  // namespace mpitrain
