// The device mesh: the one object that knows the job's layout (layout.h: world = islands x pp x dp x tp,
// this rank's coordinates) and holds one Communicator per group: the world, this rank's dp group
// and its tp group; with DiLoCo's islands also its replica group (every island's ranks of its tp
// coordinate), its island group (its place in every island) and its island (every rank of it);
// with pipeline stages its pipeline (its place in every stage), and its dp group within its stage.
// MPI groups are sub-communicators of the world (MPI_Comm_split); an NCCL communicator per group
// is bootstrapped inside its group by an MPI_Bcast of its unique id (comm_nccl.cpp), and the
// watchdog's abort path aborts every NCCL communicator that exists.
// A group that is the whole world shares the world's communicator; a group of one rank is an MPI
// communicator of one (its collectives return at once).
#pragma once

#include "mpitrain/mpi_ops.h"
#include <torch/torch.h>

#include <memory>
#include <string>

#include "mpitrain/comm.h"
#include "mpitrain/layout.h"

namespace mpitrain {

class Mesh {
 public:
  // Collective over `world` (every rank calls it). `backend` and `device` as make_communicator.
  Mesh(MpiComm world, const MeshLayout& layout, const std::string& backend, const torch::Device& device);
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  const MeshLayout& layout() const { return layout_; }
  int rank() const { return rank_; }
  int dp_rank() const { return layout_.dp_rank(rank_); }
  int tp_rank() const { return layout_.tp_rank(rank_); }
  int dp_size() const { return layout_.dp; }
  int tp_size() const { return layout_.tp; }
  // The data replica this rank computes (its windows, its dropout stream) of replicas() in all.
  int replica() const { return layout_.replica(rank_); }
  int replicas() const { return layout_.replicas(); }

  Communicator& world() { return *world_; }
  Communicator& dp() { return dp_ ? *dp_ : *world_; }  // gradients: this rank's island
  Communicator& tp() { return *tp_; }
  // Expert parallelism: this rank's ep group (tokens to their experts and back) and its
  // expert-replica group (the experts' gradients); groups of one rank with ep 1.
  int ep_rank() const { return layout_.ep_rank(rank_); }
  Communicator& ep() { return *ep_; }
  Communicator& expert_replicas() { return *expert_replicas_; }
  Communicator& replicas_comm() { return replicas_ ? *replicas_ : dp(); }  // losses, evaluation: every island
  // The rank at this rank's place in every island (DiLoCo's outer all-reduce); null without islands.
  Communicator* islands() { return islands_.get(); }
  // Every rank of this rank's island (the world without islands).
  Communicator& island() { return island_ ? *island_ : *world_; }
  // Pipeline parallelism: this rank's stage and its pipeline (the rank at its place in every stage,
  // rank s of it in stage s; the activations' point-to-point and the gradient norm), a group of one
  // rank with pp 1.
  int stage() const { return layout_.stage(rank_); }
  Communicator& pp() { return *pp_; }
  MpiComm pp_mpi() const { return pp_mpi_; }
  MpiComm world_mpi() const { return world_mpi_; }
  MpiComm island_mpi() const { return island_mpi_ != MpiComm{} ? island_mpi_ : world_mpi_; }

 private:
  MeshLayout layout_;
  int rank_ = 0;
  MpiComm world_mpi_;
  MpiComm dp_mpi_ = MpiComm{}, tp_mpi_ = MpiComm{};  // owned (MPI_Comm_split)
  MpiComm replicas_mpi_ = MpiComm{}, islands_mpi_ = MpiComm{};  // owned; islands only
  MpiComm island_mpi_ = MpiComm{};                                   // owned; islands only
  MpiComm ep_mpi_ = MpiComm{}, expert_replicas_mpi_ = MpiComm{};      // owned
  MpiComm pp_mpi_ = MpiComm{};                                        // owned
  std::unique_ptr<Communicator> world_, dp_, tp_;             // dp_ null: the world is the dp group
  std::unique_ptr<Communicator> replicas_, islands_, island_;  // null without islands
  std::unique_ptr<Communicator> ep_, expert_replicas_, pp_;
};

}  // namespace mpitrain
