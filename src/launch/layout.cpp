// The dp x tp layout rules (see layout.h).
#include "mpitrain/layout.h"

#include "mpitrain/error.h"

namespace mpitrain {

std::vector<int> MeshLayout::tp_group(int rank) const {
  std::vector<int> ranks;
  for (int r = rank - tp_rank(rank); r < rank - tp_rank(rank) + tp; ++r) ranks.push_back(r);
  return ranks;
}

std::vector<int> MeshLayout::dp_group(int rank) const {
  std::vector<int> ranks;
  for (int d = 0; d < dp; ++d) ranks.push_back(d * tp + tp_rank(rank));
  return ranks;
}

std::string MeshLayout::describe(const Topology& topo) const {
  std::string out = concat("mesh: ", world, world == 1 ? " rank" : " ranks", " = dp ", dp);
  if (tp == 1) return out;
  out += concat(" x tp ", tp, "; tp groups");
  for (int first = 0; first < world; first += tp)
    out += concat(" ", topo.hosts[topo.host_of_rank[first]], "[", rank_ranges(tp_group(first)), "]");
  return out;
}

MeshLayout plan_layout(const Topology& topo, int64_t tp) {
  if (tp < 1) throw UsageError(concat("parallel.tp must be >= 1, got ", tp));
  if (topo.size % tp != 0)
    throw UsageError(concat("parallel.tp: ", tp, " does not divide the world size ", topo.size,
                            " (world = dp x tp)"));
  for (int first = 0; first < topo.size; first += static_cast<int>(tp))
    for (int r = first + 1; r < first + tp; ++r)
      if (topo.host_of_rank[r] != topo.host_of_rank[first])
        throw UsageError(concat("parallel.tp: ", tp, ": ranks ", first, "-", first + tp - 1,
                                " would form a tp group, but rank ", first, " is on host ",
                                topo.hosts[topo.host_of_rank[first]], " and rank ", r, " on host ",
                                topo.hosts[topo.host_of_rank[r]],
                                "; a tp group is consecutive ranks of one host: give every host a "
                                "multiple of ", tp, " ranks (hostfile slots)"));
  MeshLayout l;
  l.world = topo.size;
  l.tp = static_cast<int>(tp);
  l.dp = topo.size / l.tp;
  return l;
}

}  // namespace mpitrain
