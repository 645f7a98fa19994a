// `mpitrain netcheck` (see netcheck.h).
#include "mpitrain/netcheck.h"
#include "mpitrain/mpi_native.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mpitrain/consistency.h"
#include "mpitrain/error.h"
#include "mpitrain/mpi_env.h"

namespace mpitrain {
namespace {

constexpr size_t kTextLen = 512;

// "eth0 10.0.0.5/24, ib0 192.168.1.5/24": this host's up, non-loopback IPv4 interfaces.
std::string local_interfaces() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "?";
  std::string out;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK) ||
        !(i->ifa_flags & IFF_UP))
      continue;
    char addr[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, addr, sizeof addr);
    int prefix = 0;
    if (i->ifa_netmask)
      prefix = __builtin_popcount(reinterpret_cast<sockaddr_in*>(i->ifa_netmask)->sin_addr.s_addr);
    out += concat(out.empty() ? "" : ", ", i->ifa_name, " ", addr, "/", prefix);
  }
  freeifaddrs(list);
  return out.empty() ? "(none)" : out;
}

std::string mca_setting(const char* name) {
  const std::string env = std::string("OMPI_MCA_") + name;
  const char* v = std::getenv(env.c_str());
  return v ? v : "";
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

std::string human_bytes(int64_t b) {
  if (b >= (1 << 20)) return concat(b >> 20, " MiB");
  if (b >= (1 << 10)) return concat(b >> 10, " KiB");
  return concat(b, " B");
}

struct Link {
  int a, b;            // ranks
  double latency_us;   // one-way, small message
  double bandwidth;    // GB/s, one direction
};

// `iters` round trips of `bytes` between this rank and `peer` (`first`: this rank sends first);
// the seconds they took.
double round_trips(MPI_Comm comm, bool first, int peer, std::vector<char>& buf, int bytes, int iters) {
  const double t0 = MPI_Wtime();
  for (int i = 0; i < iters; ++i) {
    if (first) {
      MPI_CHECK(MPI_Send(buf.data(), bytes, MPI_CHAR, peer, 7, comm));
      MPI_CHECK(MPI_Recv(buf.data(), bytes, MPI_CHAR, peer, 7, comm, MPI_STATUS_IGNORE));
    } else {
      MPI_CHECK(MPI_Recv(buf.data(), bytes, MPI_CHAR, peer, 7, comm, MPI_STATUS_IGNORE));
      MPI_CHECK(MPI_Send(buf.data(), bytes, MPI_CHAR, peer, 7, comm));
    }
  }
  return MPI_Wtime() - t0;
}

// Ping-pong between ranks a and b; everyone calls, the others just wait at the barriers.
Link measure_link(MPI_Comm comm, int rank, int a, int b, const NetcheckOptions& o) {
  std::vector<char> buf(static_cast<size_t>(o.p2p_bytes));
  double res[2] = {0, 0};
  MPI_CHECK(MPI_Barrier(comm));
  if (rank == a || rank == b) {
    const int peer = rank == a ? b : a;
    auto pingpong = [&](int bytes, int iters) { return round_trips(comm, rank == a, peer, buf, bytes, iters); };
    pingpong(8, 10);  // warm-up: connection set-up is not latency
    const int lat_iters = 20 * o.iters;
    const double lat = pingpong(8, lat_iters) / (2.0 * lat_iters);
    pingpong(static_cast<int>(o.p2p_bytes), 1);
    const double t = pingpong(static_cast<int>(o.p2p_bytes), o.iters);
    if (rank == a) {
      res[0] = lat * 1e6;
      res[1] = 2.0 * static_cast<double>(o.p2p_bytes) * o.iters / t / 1e9;
    }
  }
  double out[2];
  MPI_CHECK(MPI_Allreduce(res, out, 2, MPI_DOUBLE, MPI_MAX, comm));
  return {a, b, out[0], out[1]};
}

}  // namespace

std::vector<std::vector<double>> host_bandwidths(MpiComm comm_handle, const Topology& topo, int64_t bytes) {
  const MPI_Comm comm = to_mpi(comm_handle);
  const int H = static_cast<int>(topo.hosts.size());
  std::vector<int> leaders(static_cast<size_t>(H), -1);
  for (int r = topo.size - 1; r >= 0; --r) leaders[static_cast<size_t>(topo.host_of_rank[r])] = r;
  std::vector<double> mine(static_cast<size_t>(H * H), 0.0), all(mine.size(), 0.0);
  std::vector<char> buf(static_cast<size_t>(bytes));
  // The circle method: host 0 stays, the others rotate; position i meets position n - 1 - i.
  const int n = H + H % 2;  // an odd count gets a bye (-1)
  std::vector<int> ring(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ring[static_cast<size_t>(i)] = i < H ? i : -1;
  for (int round = 0; round + 1 < n; ++round) {
    MPI_CHECK(MPI_Barrier(comm));
    for (int i = 0; i < n / 2; ++i) {
      const int a = ring[static_cast<size_t>(i)], b = ring[static_cast<size_t>(n - 1 - i)];
      if (a < 0 || b < 0) continue;
      const int ra = leaders[static_cast<size_t>(std::min(a, b))], rb = leaders[static_cast<size_t>(std::max(a, b))];
      if (topo.rank != ra && topo.rank != rb) continue;
      const int peer = topo.rank == ra ? rb : ra;
      round_trips(comm, topo.rank == ra, peer, buf, 8, 3);  // the connection set up
      const double t = round_trips(comm, topo.rank == ra, peer, buf, static_cast<int>(bytes), 2);
      if (topo.rank == ra) {
        const double gbit = 4.0 * static_cast<double>(bytes) * 8 / std::max(t, 1e-9) / 1e9;
        mine[static_cast<size_t>(a * H + b)] = mine[static_cast<size_t>(b * H + a)] = gbit;
      }
    }
    std::rotate(ring.begin() + 1, ring.end() - 1, ring.end());
  }
  MPI_CHECK(MPI_Allreduce(mine.data(), all.data(), H * H, MPI_DOUBLE, MPI_MAX, comm));
  std::vector<std::vector<double>> out(static_cast<size_t>(H), std::vector<double>(static_cast<size_t>(H), 0.0));
  for (int i = 0; i < H; ++i)
    for (int j = 0; j < H; ++j) out[static_cast<size_t>(i)][static_cast<size_t>(j)] = all[static_cast<size_t>(i * H + j)];
  return out;
}

namespace {

// Mean time of an in-place float sum all-reduce of `bytes`, the slowest rank's.
double time_allreduce(MPI_Comm comm, int64_t bytes, int iters) {
  std::vector<float> v(static_cast<size_t>(std::max<int64_t>(1, bytes / 4)), 1.0f);
  const int n = static_cast<int>(v.size());
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, v.data(), n, MPI_FLOAT, MPI_SUM, comm));  // warm-up
  MPI_CHECK(MPI_Barrier(comm));
  const double t0 = MPI_Wtime();
  for (int i = 0; i < iters; ++i) MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, v.data(), n, MPI_FLOAT, MPI_SUM, comm));
  double t = (MPI_Wtime() - t0) / iters, worst = 0;
  MPI_CHECK(MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, comm));
  return worst;
}

// This rank's memory copy bandwidth in GB/s (a rank on a busy or throttled core shows up here).
double memcpy_bandwidth() {
  const size_t bytes = 64 << 20;
  std::vector<char> src(bytes, 1), dst(bytes);
  std::memcpy(dst.data(), src.data(), bytes);
  const double t0 = MPI_Wtime();
  for (int i = 0; i < 3; ++i) std::memcpy(dst.data(), src.data(), bytes);
  return 3.0 * bytes / (MPI_Wtime() - t0) / 1e9;
}

// Local interface names whose IPv4 address lies in "a.b.c.d/n".
std::vector<std::string> interfaces_in(const std::string& cidr) {
  std::vector<std::string> names;
  const auto slash = cidr.find('/');
  in_addr net{};
  if (slash == std::string::npos || inet_pton(AF_INET, cidr.substr(0, slash).c_str(), &net) != 1) return names;
  const int bits = std::atoi(cidr.c_str() + slash + 1);
  const uint32_t mask = bits <= 0 ? 0 : bits >= 32 ? 0xffffffffu : ~((1u << (32 - bits)) - 1);
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return names;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    const uint32_t a = ntohl(reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr);
    if ((a & mask) == (ntohl(net.s_addr) & mask)) names.emplace_back(i->ifa_name);
  }
  freeifaddrs(list);
  return names;
}

}  // namespace

std::string follow_mpi_interface_for_nccl() {
  if (const char* set = std::getenv("NCCL_SOCKET_IFNAME")) return set;
  std::string mpi = mca_setting("btl_tcp_if_include");
  // MPICH's netmods: ch4:ucx's UCX_NET_DEVICES (InfiniBand ports such as mlx5_0:1 are not
  // sockets: only names of network interfaces count), ch4:ofi's FI_TCP_IFACE.
  for (const char* var : {"UCX_NET_DEVICES", "FI_TCP_IFACE"}) {
    const char* v = std::getenv(var);
    if (!mpi.empty() || !v) continue;
    for (const auto& name : split_list(v, ','))
      if (!name.empty() && if_nametoindex(name.c_str()) != 0) mpi += (mpi.empty() ? "" : ",") + name;
  }
  if (mpi.empty()) return "";
  std::vector<std::string> names;
  for (const auto& item : split_list(mpi, ',')) {
    if (item.find('/') != std::string::npos) {
      for (auto& n : interfaces_in(item)) names.push_back(n);
    } else if (!item.empty()) {
      names.push_back(item);
    }
  }
  if (names.empty()) return "";
  std::string value = "=";  // '=': exact names, not prefixes
  for (size_t i = 0; i < names.size(); ++i) value += (i ? "," : "") + names[i];
  setenv("NCCL_SOCKET_IFNAME", value.c_str(), 0);
  return value;
}

int run_netcheck(const NetcheckOptions& o, MpiComm comm_handle, int local_gpus, const std::string& torch_version,
                 const std::function<GpuFacts(int)>& gpu_facts) {
  const MPI_Comm comm = to_mpi(comm_handle);
  const Topology topo = Topology::discover(comm_handle);
  const bool root = topo.rank == 0;
  auto say = [&](const std::string& line) {
    if (root) std::printf("%s\n", line.c_str());
  };
  say("netcheck: " + topo.host_map());

  // ---- hosts: ranks, GPUs, interfaces, binary ----
  Fingerprints fp;
  fp.binary = binary_fingerprint();
  auto problems = compare_fingerprints(comm_handle, topo, fp);
  const auto ifaces = allgather_text(comm_handle, topo.local_rank == 0 ? local_interfaces() : "", kTextLen);
  std::vector<int> gpus(topo.size);
  MPI_CHECK(MPI_Allgather(&local_gpus, 1, MPI_INT, gpus.data(), 1, MPI_INT, comm));
  std::vector<uint32_t> bins(topo.size);
  MPI_CHECK(MPI_Allgather(&fp.binary, 1, MPI_UINT32_T, bins.data(), 1, MPI_UINT32_T, comm));
  std::vector<int> leaders(topo.hosts.size(), -1);
  for (int r = topo.size - 1; r >= 0; --r) leaders[topo.host_of_rank[r]] = r;
  char line[1024];
  say("\nhosts:");
  std::snprintf(line, sizeof line, "  %-20s %-10s %5s %5s  %-8s  %s", "host", "ranks", "local", "gpus",
                "binary", "interfaces (IPv4, up)");
  say(line);
  for (size_t h = 0; h < topo.hosts.size(); ++h) {
    std::vector<int> ranks;
    for (int r = 0; r < topo.size; ++r)
      if (topo.host_of_rank[r] == static_cast<int>(h)) ranks.push_back(r);
    char bin[16];
    std::snprintf(bin, sizeof bin, "%08x", bins[leaders[h]]);
    std::snprintf(line, sizeof line, "  %-20s %-10s %5zu %5d  %-8s  %s", topo.hosts[h].c_str(),
                  rank_ranges(ranks).c_str(), ranks.size(), gpus[leaders[h]], bin, ifaces[leaders[h]].c_str());
    say(line);
  }
  const std::string btl = mca_setting("btl_tcp_if_include"), oob = mca_setting("oob_tcp_if_include");
  say(concat("MPI TCP interfaces: btl_tcp_if_include=", btl.empty() ? "(OpenMPI default: all)" : btl,
             " oob_tcp_if_include=", oob.empty() ? "(OpenMPI default: all)" : oob));
  const std::string nccl_if = follow_mpi_interface_for_nccl();
  say(concat("NCCL socket interface: ", nccl_if.empty() ? "(NCCL's own choice)" : nccl_if));

  // ---- the pre-flight record: what every rank runs, each distinct value with its ranks ----
  const PreflightVerdict preflight =
      gather_preflight(comm_handle, topo, torch_version, gpu_facts(local_gpus > 0 ? topo.local_rank % local_gpus : -1),
                       local_gpus > 0);
  for (const auto& e : preflight.errors) problems.push_back(e);
  say("\npreflight (every rank's record; a value's ranks):");
  for (const auto& row : preflight.table) {
    const auto t1 = row.find('\t'), t2 = row.find('\t', t1 + 1);
    std::snprintf(line, sizeof line, "  %-20s %-40s %s", row.substr(0, t1).c_str(),
                  row.substr(t1 + 1, t2 - t1 - 1).c_str(), row.substr(t2 + 1).c_str());
    say(line);
  }

  // ---- point to point between hosts (between two local ranks on a single host) ----
  std::vector<std::pair<int, int>> pairs;
  const int H = static_cast<int>(leaders.size());
  if (H == 1 && topo.size >= 2) pairs.emplace_back(0, 1);
  else if (H <= 8)
    for (int i = 0; i < H; ++i)
      for (int j = i + 1; j < H; ++j) pairs.emplace_back(leaders[i], leaders[j]);
  else
    for (int i = 0; i < H; ++i) pairs.emplace_back(leaders[i], leaders[(i + 1) % H]);
  std::vector<Link> links;
  for (auto [a, b] : pairs) links.push_back(measure_link(comm, topo.rank, a, b, o));
  std::vector<double> bws;
  for (const auto& l : links) bws.push_back(l.bandwidth);
  const double bw_median = median(bws);
  std::vector<std::string> slow;
  if (!links.empty()) {
    say(concat("\npoint-to-point ", H == 1 ? "(intra-host, ranks 0 and 1)" : "(host leaders)", ": 8 B latency, ",
               human_bytes(o.p2p_bytes), " ping-pong bandwidth"));
    std::snprintf(line, sizeof line, "  %-20s %-20s %12s %12s", "from", "to", "latency us", "GB/s");
    say(line);
    for (const auto& l : links) {
      const bool is_slow = links.size() > 1 && l.bandwidth < o.slow_factor * bw_median;
      std::snprintf(line, sizeof line, "  %-20s %-20s %12.1f %12.3f%s",
                    concat(topo.hosts[topo.host_of_rank[l.a]], "[", l.a, "]").c_str(),
                    concat(topo.hosts[topo.host_of_rank[l.b]], "[", l.b, "]").c_str(), l.latency_us, l.bandwidth,
                    is_slow ? "  SLOW" : "");
      say(line);
      if (is_slow)
        slow.push_back(concat("link ", topo.hosts[topo.host_of_rank[l.a]], " -> ", topo.hosts[topo.host_of_rank[l.b]],
                              " at ", l.bandwidth, " GB/s, median ", bw_median));
    }
  }

  // ---- all-reduce bus bandwidth ----
  if (topo.size >= 2) {
    say(concat("\nall-reduce (MPI, float32 sum, in place; busbw = algbw x 2(n-1)/n, n = ", topo.size, ")"));
    std::snprintf(line, sizeof line, "  %12s %12s %12s %12s", "size", "time us", "algbw GB/s", "busbw GB/s");
    say(line);
    for (int64_t bytes = 8; bytes <= o.max_bytes; bytes *= (bytes < 1024 ? 128 : 8)) {
      const int iters = bytes <= (1 << 20) ? 10 * o.iters : o.iters;
      const double t = time_allreduce(comm, bytes, iters);
      const double algbw = static_cast<double>(bytes) / t / 1e9;
      const double busbw = algbw * 2.0 * (topo.size - 1) / topo.size;
      std::snprintf(line, sizeof line, "  %12s %12.1f %12.3f %12.3f", human_bytes(bytes).c_str(), t * 1e6, algbw,
                    busbw);
      say(line);
    }
  }

  // ---- per-rank memory bandwidth: slow ranks ----
  const double mine = memcpy_bandwidth();
  std::vector<double> mem(topo.size);
  MPI_CHECK(MPI_Allgather(&mine, 1, MPI_DOUBLE, mem.data(), 1, MPI_DOUBLE, comm));
  const double mem_median = median(mem);
  std::vector<int> slow_ranks;
  for (int r = 0; r < topo.size; ++r)
    if (mem[r] < o.slow_factor * mem_median) slow_ranks.push_back(r);
  say(concat("\nmemory copy per rank: median ", mem_median, " GB/s; slow ranks: ",
             slow_ranks.empty() ? std::string("none") : rank_ranges(slow_ranks)));
  for (int r : slow_ranks)
    slow.push_back(concat("rank ", r, " on ", topo.hosts[topo.host_of_rank[r]], " copies at ", mem[r], " GB/s"));

  // ---- verdict ----
  for (const auto& s : slow) say("WARNING: " + s);
  for (const auto& w : preflight.warnings) say("WARNING: " + w);
  for (const auto& p : problems) say("INCONSISTENT: " + p);
  say(problems.empty() ? concat("netcheck: OK (", H, H == 1 ? " host, " : " hosts, ", topo.size, " ranks)")
                       : "netcheck: FAILED");
  if (root) std::fflush(stdout);
  return problems.empty() ? 0 : 1;
}

}  // namespace mpitrain
