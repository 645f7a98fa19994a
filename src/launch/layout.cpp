// The dp x tp layout rules (see layout.h).
#include "mpitrain/layout.h"

#include <algorithm>
#include <cstdio>

#include "mpitrain/error.h"

namespace mpitrain {

std::vector<int> MeshLayout::tp_group(int rank) const {
  std::vector<int> ranks;
  for (int r = rank - tp_rank(rank); r < rank - tp_rank(rank) + tp; ++r) ranks.push_back(r);
  return ranks;
}

std::vector<int> MeshLayout::dp_group(int rank) const {
  std::vector<int> ranks;
  const int first = island(rank) * island_size() + stage(rank) * stage_size();
  for (int d = 0; d < dp; ++d) ranks.push_back(first + d * tp + tp_rank(rank));
  return ranks;
}

std::vector<int> MeshLayout::replica_group(int rank) const {
  std::vector<int> ranks;
  for (int i = 0; i < islands; ++i)
    for (int d = 0; d < dp; ++d) ranks.push_back(i * island_size() + stage(rank) * stage_size() + d * tp + tp_rank(rank));
  return ranks;
}

std::vector<int> MeshLayout::island_group(int rank) const {
  std::vector<int> ranks;
  for (int i = 0; i < islands; ++i) ranks.push_back(i * island_size() + rank % island_size());
  return ranks;
}

std::vector<int> MeshLayout::pp_group(int rank) const {
  std::vector<int> ranks;
  for (int s = 0; s < pp; ++s) ranks.push_back(island(rank) * island_size() + s * stage_size() + rank % stage_size());
  return ranks;
}

std::vector<int> MeshLayout::ep_group(int rank) const {
  std::vector<int> ranks;
  const std::vector<int> dp_ranks = dp_group(rank);
  const int first = dp_rank(rank) - ep_rank(rank);
  for (int e = 0; e < ep; ++e) ranks.push_back(dp_ranks[static_cast<size_t>(first + e)]);
  return ranks;
}

std::vector<int> MeshLayout::expert_replica_group(int rank) const {
  std::vector<int> ranks;
  const std::vector<int> dp_ranks = dp_group(rank);
  for (int d = ep_rank(rank); d < dp; d += ep) ranks.push_back(dp_ranks[static_cast<size_t>(d)]);
  return ranks;
}

std::string MeshLayout::describe(const Topology& topo) const {
  std::string out = concat("mesh: ", world, world == 1 ? " rank" : " ranks", " = ", islands > 1 ? concat(islands, " islands x ") : std::string(),
                           pp > 1 ? concat("pp ", pp, " x ") : std::string(), "dp ", dp);
  if (ep > 1)
    out += concat(" (ep ", ep, ": ", dp / ep, dp / ep == 1 ? " group" : " groups", " of ", ep,
                  " ranks each holding 1/", ep, " of the experts)");
  if (tp > 1) {
    out += concat(" x tp ", tp, "; tp groups");
    for (int first = 0; first < world; first += tp)
      out += concat(" ", topo.hosts[topo.host_of_rank[first]], "[", rank_ranges(tp_group(first)), "]");
  }
  // "; stages a[0-1] b[2-3]": `count` runs of `size` consecutive ranks, each with its hosts
  const auto runs = [&](const char* what, int count, int size) {
    out += concat("; ", what);
    for (int i = 0; i < count; ++i) {
      std::vector<int> ranks;
      for (int r = i * size; r < (i + 1) * size; ++r) ranks.push_back(r);
      const std::string& a = topo.hosts[topo.host_of_rank[ranks.front()]];
      const std::string& b = topo.hosts[topo.host_of_rank[ranks.back()]];
      out += concat(" ", a, a == b ? std::string() : "-" + b, "[", rank_ranges(ranks), "]");
    }
  };
  if (pp > 1) runs("stages", islands * pp, stage_size());
  if (islands > 1) runs("islands", islands, island_size());
  return out;
}

MeshLayout plan_layout(const Topology& topo, int64_t tp, int64_t islands, int64_t ep, int64_t pp) {
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
  if (pp < 1 || topo.size % pp != 0 || (topo.size / pp) % tp != 0)
    throw UsageError(concat("parallel.pp: ", pp, " does not divide the world size ", topo.size,
                            " into stages of whole tp groups (world = pp x dp x tp)"));
  MeshLayout l;
  l.world = topo.size;
  l.tp = static_cast<int>(tp);
  if (islands == -1) {  // one per host: each host's ranks consecutive, every host as many
    islands = static_cast<int64_t>(topo.hosts.size());
    const int per = topo.size / static_cast<int>(islands);
    for (int r = 0; r < topo.size; ++r)
      if (per * static_cast<int>(islands) != topo.size || topo.host_of_rank[r] != topo.host_of_rank[(r / per) * per])
        throw UsageError(concat("parallel.islands: host needs every host to run as many consecutive ranks; rank ", r,
                                " runs on host ", topo.hosts[topo.host_of_rank[r]], " (", topo.size, " ranks on ",
                                topo.hosts.size(), " hosts): give every host the same number of slots, or a number "
                                "of islands"));
  }
  l.pp = static_cast<int>(pp);
  if (islands < 1 || topo.size % islands != 0)
    throw UsageError(concat("parallel.islands: ", islands, " does not divide the world size ", topo.size,
                            " (world = islands x pp x dp x tp; every island as many ranks)"));
  if ((topo.size / islands) % tp != 0)
    throw UsageError(concat("parallel.islands: ", islands, " islands of ", topo.size / islands,
                            " ranks would split a tp group of parallel.tp ", tp,
                            " (an island is a whole number of tp groups)"));
  l.islands = static_cast<int>(islands);
  if ((topo.size / islands) % (pp * tp) != 0)
    throw UsageError(concat("parallel.pp: ", pp, " does not divide each of the ", islands, " islands' ", topo.size / islands,
                            " ranks into stages of whole tp groups (an island = pp x dp x tp)"));
  l.dp = topo.size / l.pp / l.tp / l.islands;
  if (ep < 1 || l.dp % ep != 0)
    throw UsageError(concat("parallel.ep: ", ep, " does not divide the ", l.dp, " data-parallel ranks (world ", topo.size,
                            " = dp ", l.dp, tp > 1 ? concat(" x tp ", tp) : std::string(),
                            "; each ep group is ep of the dp ranks)"));
  l.ep = static_cast<int>(ep);
  return l;
}

namespace {
bool slow_link(const std::vector<std::vector<double>>& gbit, size_t i, size_t j, double slow_gbit) {
  double fastest = 0;
  for (size_t a = 0; a < gbit.size(); ++a)
    for (size_t b = 0; b < gbit.size(); ++b)
      if (a != b) fastest = std::max(fastest, gbit[a][b]);
  return gbit[i][j] < slow_gbit || gbit[i][j] < 0.25 * fastest;
}
}  // namespace

std::vector<int> group_hosts(const std::vector<std::vector<double>>& gbit, double slow_gbit) {
  const size_t H = gbit.size();
  std::vector<int> group(H, -1);
  int next = 0;
  for (size_t first = 0; first < H; ++first) {  // each ungrouped host starts a group: all it reaches
    if (group[first] >= 0) continue;
    std::vector<size_t> todo = {first};
    group[first] = next;
    while (!todo.empty()) {
      const size_t i = todo.back();
      todo.pop_back();
      for (size_t j = 0; j < H; ++j)
        if (group[j] < 0 && !slow_link(gbit, i, j, slow_gbit)) {
          group[j] = next;
          todo.push_back(j);
        }
    }
    ++next;
  }
  return group;
}

std::string describe_groups(const Topology& topo, const std::vector<std::vector<double>>& gbit,
                            const std::vector<int>& group, double slow_gbit) {
  std::string links;
  for (size_t i = 0; i < gbit.size(); ++i)
    for (size_t j = i + 1; j < gbit.size(); ++j) {
      char value[32];
      std::snprintf(value, sizeof value, "%.3g", gbit[i][j]);
      links += concat(links.empty() ? "" : ", ", topo.hosts[i], "-", topo.hosts[j], " ", value,
                      slow_link(gbit, i, j, slow_gbit) ? " (slow)" : "");
    }
  const int groups = group.empty() ? 0 : *std::max_element(group.begin(), group.end()) + 1;
  std::string members;
  for (int g = 0; g < groups; ++g) {
    if (g > 0) members += " |";
    for (size_t h = 0; h < group.size(); ++h)
      if (group[h] == g) members += " " + topo.hosts[h];
  }
  return concat("links between hosts (Gbit/s): ", links.empty() ? std::string("none") : links, "; ", groups,
                groups == 1 ? " group:" : " groups:", members);
}

int64_t islands_of_groups(const Topology& topo, const std::vector<int>& group) {
  const int groups = *std::max_element(group.begin(), group.end()) + 1;
  if (groups == 1) return 1;
  if (topo.size % groups != 0)
    throw UsageError(concat("parallel.islands: auto: the links make ", groups, " groups of hosts, which do not divide the "
                            "world of ", topo.size, " ranks into islands of as many ranks; give every group as many "
                            "ranks, or set parallel.islands to host or a number"));
  const int per = topo.size / groups;
  for (int r = 0; r < topo.size; ++r)
    if (group[static_cast<size_t>(topo.host_of_rank[r])] != group[static_cast<size_t>(topo.host_of_rank[(r / per) * per])] ||
        (r % per == 0 && r > 0 &&
         group[static_cast<size_t>(topo.host_of_rank[r])] == group[static_cast<size_t>(topo.host_of_rank[r - 1])]))
      throw UsageError(concat("parallel.islands: auto: the links make ", groups, " groups of hosts, but rank ", r, " (host ",
                              topo.hosts[topo.host_of_rank[r]], ") does not fall in its group's run of ", per,
                              " consecutive ranks: every group needs as many ranks, its hosts' ranks consecutive "
                              "(hostfile order); or set parallel.islands to host or a number"));
  return groups;
}

}  // namespace mpitrain
