// Start-up consistency check across ranks (see consistency.h).
#include "mpitrain/consistency.h"
#include "mpitrain/mpi_native.h"

#include <sys/stat.h>

#include <array>
#include <fstream>
#include <iterator>
#include <map>

#include "mpitrain/error.h"
#include "mpitrain/h5.h"

namespace mpitrain {

uint32_t binary_fingerprint() {
  static const uint32_t crc = [] {
    std::ifstream in("/proc/self/exe", std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return h5::crc32(bytes.data(), bytes.size());
  }();
  return crc;
}

uint32_t shard_list_fingerprint(const std::vector<std::string>& paths) {
  std::string desc;
  for (const auto& p : paths) {
    struct stat st {};
    const long long size = ::stat(p.c_str(), &st) == 0 ? static_cast<long long>(st.st_size) : -1;
    const auto slash = p.rfind('/');
    desc += concat(slash == std::string::npos ? p : p.substr(slash + 1), ":", size, ";");
  }
  return h5::crc32(desc.data(), desc.size());
}

std::vector<std::string> compare_fingerprints(MpiComm comm_handle, const Topology& topo, const Fingerprints& mine) {
  const MPI_Comm comm = to_mpi(comm_handle);
  std::array<uint32_t, 3> local{mine.binary, mine.config, mine.shards};
  std::vector<uint32_t> all(static_cast<size_t>(topo.size) * 3);
  MPI_CHECK(MPI_Allgather(local.data(), 3, MPI_UINT32_T, all.data(), 3, MPI_UINT32_T, comm));
  static const char* kWhat[3] = {"mpitrain binary", "resolved config", "shard list"};
  std::vector<std::string> problems;
  for (int f = 0; f < 3; ++f) {
    std::map<int, std::vector<int>> odd_by_host;  // host index -> ranks that differ from rank 0
    for (int r = 1; r < topo.size; ++r)
      if (all[static_cast<size_t>(r) * 3 + f] != all[f]) odd_by_host[topo.host_of_rank[r]].push_back(r);
    for (const auto& [host, ranks] : odd_by_host)
      problems.push_back(concat(kWhat[f], " differs on host ", topo.hosts[host], " (ranks ",
                                rank_ranges(ranks), ") from rank 0's on ", topo.hosts[topo.host_of_rank[0]],
                                f == 0 ? ": copy the same build to every host" : ""));
  }
  return problems;
}

void check_consistency(MpiComm comm, const Topology& topo, const Fingerprints& mine) {
  auto problems = compare_fingerprints(comm, topo, mine);
  if (problems.empty()) return;
  std::string msg = "consistency check failed: " + problems.front();
  if (problems.size() > 1) msg += concat(" (and ", problems.size() - 1, " more)");
  throw UsageError(msg);
}

}  // namespace mpitrain
