// The device mesh's communicators (see mesh.h).
#include "mpitrain/mesh.h"

#include "mpitrain/error.h"

namespace mpitrain {

Mesh::Mesh(MPI_Comm world, const MeshLayout& layout, const std::string& backend, const torch::Device& device)
    : layout_(layout), world_mpi_(world) {
  MPI_CHECK(MPI_Comm_rank(world, &rank_));
  int size = 0;
  MPI_CHECK(MPI_Comm_size(world, &size));
  MPITRAIN_CHECK(size == layout_.world, concat("Mesh: layout for ", layout_.world, " ranks on a world of ", size));
  world_ = make_communicator(backend, world, device);
  // Ranks of one tp group share rank / tp; ranks of one dp group share rank % tp. Both splits are
  // collective over the world, so every rank makes both even when one is trivial.
  MPI_CHECK(MPI_Comm_split(world, layout_.dp_rank(rank_), rank_, &tp_mpi_));
  MPI_CHECK(MPI_Comm_split(world, layout_.tp_rank(rank_), rank_, &dp_mpi_));
  if (layout_.tp > 1) {
    dp_ = make_communicator(backend, dp_mpi_, device);
    tp_ = make_communicator(backend, tp_mpi_, device);
  } else {
    tp_ = make_mpi_communicator(tp_mpi_);  // one rank: nothing to communicate
  }
}

Mesh::~Mesh() {
  tp_.reset();  // communicators before the MPI communicators they use
  dp_.reset();
  world_.reset();
  if (tp_mpi_ != MPI_COMM_NULL) MPI_Comm_free(&tp_mpi_);
  if (dp_mpi_ != MPI_COMM_NULL) MPI_Comm_free(&dp_mpi_);
}

}  // namespace mpitrain
