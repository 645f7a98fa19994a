// The device mesh's communicators (see mesh.h).
#include "mpitrain/mesh.h"

#include "mpitrain/error.h"

namespace mpitrain {

// Through mpi_ops.h only: compiled once for every MPI family.
Mesh::Mesh(MpiComm world, const MeshLayout& layout, const std::string& backend, const torch::Device& device)
    : layout_(layout), world_mpi_(world) {
  rank_ = mpi::rank(world);
  const int size = mpi::size(world);
  MPITRAIN_CHECK(size == layout_.world, concat("Mesh: layout for ", layout_.world, " ranks on a world of ", size));
  world_ = make_communicator(backend, world, device);
  // Ranks of one tp group share their stage and their replica in it; ranks of one dp group share
  // their stage, island and tp coordinate. Both splits are collective over the world, so every
  // rank makes both even when one is trivial.
  tp_mpi_ = mpi::split(world, rank_ / layout_.tp, rank_);  // (a tp group: tp consecutive ranks)
  // A dp group: one island's ranks of one stage at one tp coordinate.
  const int dp_group_key = (layout_.island(rank_) * layout_.pp + layout_.stage(rank_)) * layout_.tp + layout_.tp_rank(rank_);
  dp_mpi_ = mpi::split(world, dp_group_key, rank_);
  if (layout_.tp > 1 || layout_.islands > 1 || layout_.pp > 1) dp_ = make_communicator(backend, dp_mpi_, device);
  // A pipeline: the rank at its place in each stage of its island.
  pp_mpi_ = mpi::split(world, layout_.island(rank_) * layout_.stage_size() + rank_ % layout_.stage_size(), rank_);
  pp_ = layout_.pp > 1 ? make_communicator(backend, pp_mpi_, device) : make_mpi_communicator(pp_mpi_);
  if (layout_.tp > 1) {
    tp_ = make_communicator(backend, tp_mpi_, device);
  } else {
    tp_ = make_mpi_communicator(tp_mpi_);  // one rank: nothing to communicate
  }
  // Expert parallelism: an ep group is ep consecutive ranks of a dp group; its expert replicas
  // the dp group's ranks at the same place in theirs (both collective over the world).
  ep_mpi_ = mpi::split(world, dp_group_key * layout_.dp + layout_.dp_rank(rank_) / layout_.ep, rank_);
  expert_replicas_mpi_ = mpi::split(world, dp_group_key * layout_.ep + layout_.ep_rank(rank_), rank_);
  ep_ = layout_.ep > 1 ? make_communicator(backend, ep_mpi_, device) : make_mpi_communicator(ep_mpi_);
  expert_replicas_ = layout_.ep > 1 && layout_.dp > layout_.ep ? make_communicator(backend, expert_replicas_mpi_, device)
                                                                : make_mpi_communicator(expert_replicas_mpi_);
  if (layout_.islands > 1) {  // DiLoCo: every island's replicas (data, evaluation); the outer all-reduce
    replicas_mpi_ = mpi::split(world, layout_.stage(rank_) * layout_.tp + layout_.tp_rank(rank_), rank_);
    islands_mpi_ = mpi::split(world, rank_ % layout_.island_size(), rank_);
    island_mpi_ = mpi::split(world, layout_.island(rank_), rank_);
    replicas_ = make_communicator(backend, replicas_mpi_, device);
    islands_ = make_communicator(backend, islands_mpi_, device);
    island_ = make_communicator(backend, island_mpi_, device);
  }
}

Mesh::~Mesh() {
  pp_.reset();
  expert_replicas_.reset();  // communicators before the MPI communicators they use
  ep_.reset();
  island_.reset();
  islands_.reset();
  replicas_.reset();
  tp_.reset();
  dp_.reset();
  world_.reset();
  mpi::free(tp_mpi_);
  mpi::free(dp_mpi_);
  mpi::free(replicas_mpi_);
  mpi::free(islands_mpi_);
  mpi::free(island_mpi_);
  mpi::free(ep_mpi_);
  mpi::free(expert_replicas_mpi_);
  mpi::free(pp_mpi_);
}

}  // namespace mpitrain
