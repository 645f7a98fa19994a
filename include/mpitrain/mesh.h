// The device mesh: the one object that knows the job's layout (layout.h: world = dp x tp, this
// rank's coordinates) and holds one Communicator per group: the world, this rank's dp group and
// its tp group. MPI groups are sub-communicators of the world (MPI_Comm_split); an NCCL
// communicator per group is bootstrapped inside its group by an MPI_Bcast of its unique id
// (comm_nccl.cpp), and the watchdog's abort path aborts every NCCL communicator that exists.
// A group that is the whole world shares the world's communicator; a group of one rank is an MPI
// communicator of one (its collectives return at once).
#pragma once

#include <mpi.h>
#include <torch/torch.h>

#include <memory>
#include <string>

#include "mpitrain/comm.h"
#include "mpitrain/layout.h"

namespace mpitrain {

class Mesh {
 public:
  // Collective over `world` (every rank calls it). `backend` and `device` as make_communicator.
  Mesh(MPI_Comm world, const MeshLayout& layout, const std::string& backend, const torch::Device& device);
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  const MeshLayout& layout() const { return layout_; }
  int rank() const { return rank_; }
  int dp_rank() const { return layout_.dp_rank(rank_); }
  int tp_rank() const { return layout_.tp_rank(rank_); }
  int dp_size() const { return layout_.dp; }
  int tp_size() const { return layout_.tp; }

  Communicator& world() { return *world_; }
  Communicator& dp() { return dp_ ? *dp_ : *world_; }
  Communicator& tp() { return *tp_; }
  MPI_Comm world_mpi() const { return world_mpi_; }

 private:
  MeshLayout layout_;
  int rank_ = 0;
  MPI_Comm world_mpi_;
  MPI_Comm dp_mpi_ = MPI_COMM_NULL, tp_mpi_ = MPI_COMM_NULL;  // owned (MPI_Comm_split)
  std::unique_ptr<Communicator> world_, dp_, tp_;             // dp_ null: the world is the dp group
};

}  // namespace mpitrain
