// Pre-flight record and its rules (see preflight.h).
#include "mpitrain/preflight.h"
#include "mpitrain/mpi_native.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>

#include "mpitrain/consistency.h"
#include "mpitrain/error.h"
#include "mpitrain/log.h"

namespace mpitrain {
namespace {

constexpr size_t kRecordBytes = 2048;  // the allgathered record: values joined by '\n'

// Why a difference breaks the job, as the error's last words.
const char* fix_for(const std::string& key) {
  if (key == "mpitrain") return "copy the same build to every host";
  if (key == "mpi") return "every rank must load the same MPI library (the same module, image or LD_LIBRARY_PATH)";
  return "install the same version on every host (the same container image or modules)";
}

std::string gib(double bytes) {
  char buf[32];
  if (bytes < (1 << 30)) std::snprintf(buf, sizeof buf, "%.0f MiB", bytes / (1 << 20));
  else std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / (1 << 30));
  return buf;
}

double shm_bytes() {
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) != 0) return -1;
  return static_cast<double>(st.f_blocks) * static_cast<double>(st.f_frsize);
}

bool lo_or_docker(const std::string& name) {
  return name == "lo" || name.rfind("docker", 0) == 0;
}

// The interface NCCL's socket transport would take with NCCL_SOCKET_IFNAME unset: an ib*
// interface first, else any up IPv4 interface but lo and docker*, else those.
std::string nccl_default_interface() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "?";
  std::string ib, other, fallback;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
    const std::string name = i->ifa_name;
    if (name.rfind("ib", 0) == 0 && ib.empty()) ib = name;
    else if (!lo_or_docker(name) && other.empty()) other = name;
    else if (fallback.empty() || fallback == "lo") fallback = name;
  }
  freeifaddrs(list);
  return !ib.empty() ? ib : !other.empty() ? other : fallback;
}

// The interface(s) MPI's traffic was pinned to, as "VARIABLE=value": Open MPI's TCP btl,
// MPICH's ch4:ucx (UCX_NET_DEVICES) or ch4:ofi tcp provider (FI_TCP_IFACE).
std::string mpi_pinned_interface() {
  for (const char* var : {"OMPI_MCA_btl_tcp_if_include", "UCX_NET_DEVICES", "FI_TCP_IFACE"})
    if (const char* v = std::getenv(var); v && *v) return concat(var, "=", v);
  return "";
}

// Interface names in a list such as "=eth0,eth1", "eth0", "mlx5_0:1,eth0" (UCX's device:port),
// "10.0.0.0/24" (a CIDR range stays as written).
std::set<std::string> interface_names(std::string list) {
  if (!list.empty() && (list[0] == '=' || list[0] == '^')) list = list.substr(1);
  std::set<std::string> names;
  for (std::string item : split_list(list, ',')) {
    if (item.find('/') == std::string::npos) item = item.substr(0, item.find(':'));
    if (!item.empty()) names.insert(item);
  }
  return names;
}

// The interfaces a record's NCCL field names: "auto: eth0" (NCCL's own pick), or the names or
// prefixes of NCCL_SOCKET_IFNAME ("=eth0" exact, "eth" a prefix); an exclusion list ("^docker")
// names none that NCCL would use.
std::set<std::string> nccl_interface_names(const std::string& field) {
  const std::string kAuto = "auto: ", kSet = "NCCL_SOCKET_IFNAME=";
  if (field.rfind(kAuto, 0) == 0) return {field.substr(kAuto.size())};
  if (field.rfind(kSet, 0) != 0) return {};
  const std::string list = field.substr(kSet.size());
  if (!list.empty() && list[0] == '^') return {};
  return interface_names(list);
}

// Ranks, grouped under their hosts: "host a (ranks 0-1), host b (rank 2)".
std::string ranks_on_hosts(const std::vector<int>& ranks, const Topology& topo) {
  std::map<int, std::vector<int>> by_host;
  for (int r : ranks) by_host[topo.host_of_rank[r]].push_back(r);
  std::string out;
  for (const auto& [h, rs] : by_host)
    out += concat(out.empty() ? "" : ", ", "host ", topo.hosts[h], " (rank", rs.size() == 1 ? " " : "s ",
                  rank_ranges(rs), ")");
  return out;
}

// The test hook (tests/cli_test.sh): MPITRAIN_TEST_PREFLIGHT="RANK:KEY=VALUE[;...]" changes this
// rank's record as another installation would.
void apply_test_hook(PreflightRecord& rec, int rank) {
  const char* hook = std::getenv("MPITRAIN_TEST_PREFLIGHT");
  if (!hook) return;
  for (const auto& item : split_list(hook, ';')) {
    const size_t colon = item.find(':'), eq = item.find('=');
    if (colon == std::string::npos || eq == std::string::npos || eq < colon) continue;
    if (std::atoi(item.substr(0, colon).c_str()) != rank) continue;
    rec.at(item.substr(colon + 1, eq - colon - 1)) = item.substr(eq + 1);
  }
}

}  // namespace

const std::vector<PreflightFieldInfo>& preflight_fields() {
  static const std::vector<PreflightFieldInfo> fields = {
      {"mpitrain", "mpitrain", PreflightRule::kBreaks},
      {"libtorch", "libtorch", PreflightRule::kBreaks},
      {"mpi", "MPI library", PreflightRule::kBreaks},
      {"cuda_runtime", "CUDA runtime", PreflightRule::kBreaks},
      {"nccl", "NCCL", PreflightRule::kBreaks},
      {"cuda_driver", "CUDA driver", PreflightRule::kWarns},
      {"gpu", "GPU", PreflightRule::kWarns},
      {"bus_id", "GPU bus id", PreflightRule::kOwn},
      {"shm", "/dev/shm", PreflightRule::kOwn},
      {"nccl_if", "NCCL interface", PreflightRule::kOwn},
      {"mpi_if", "MPI interface", PreflightRule::kOwn},
      {"local_rank", "launcher local rank", PreflightRule::kOwn},
  };
  return fields;
}

namespace {
size_t field_index(const std::string& key) {
  const auto& f = preflight_fields();
  for (size_t i = 0; i < f.size(); ++i)
    if (key == f[i].key) return i;
  throw Error(concat("preflight: no field '", key, "'"));
}
}  // namespace

const std::string& PreflightRecord::get(const std::string& key) const { return values.at(field_index(key)); }
std::string& PreflightRecord::at(const std::string& key) {
  values.resize(preflight_fields().size());
  return values.at(field_index(key));
}

std::string launcher_local_rank(int world_size) {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PALS_LOCAL_RANKID",
                          "MV2_COMM_WORLD_LOCAL_RANK"})
    if (const char* v = std::getenv(var); v && *v) return concat(var, "=", v);
  const char* tasks = std::getenv("SLURM_STEP_NUM_TASKS");
  if (const char* v = std::getenv("SLURM_LOCALID"); v && *v && tasks && std::atoi(tasks) == world_size)
    return concat("SLURM_LOCALID=", v);
  return "";
}

PreflightRecord collect_preflight(const Topology& topo, const std::string& torch_version, const GpuFacts& gpu) {
  PreflightRecord rec;
  rec.values.resize(preflight_fields().size());
  char build[16];
  std::snprintf(build, sizeof build, "%08x", binary_fingerprint());
  rec.at("mpitrain") = concat(MPITRAIN_VERSION, " (build ", build, ")");
  rec.at("libtorch") = torch_version;
  rec.at("mpi") = mpi_library();
  rec.at("cuda_runtime") = gpu.cuda_runtime;
  rec.at("nccl") = gpu.nccl;
  rec.at("cuda_driver") = gpu.cuda_driver;
  rec.at("gpu") = gpu.gpu;
  rec.at("bus_id") = gpu.bus_id;
  const double shm = shm_bytes();
  rec.at("shm") = shm < 0 ? "(none)" : gib(shm);
  const char* nccl_if = std::getenv("NCCL_SOCKET_IFNAME");
  rec.at("nccl_if") = nccl_if ? concat("NCCL_SOCKET_IFNAME=", nccl_if) : concat("auto: ", nccl_default_interface());
  rec.at("mpi_if") = mpi_pinned_interface();
  rec.at("local_rank") = launcher_local_rank(topo.size);
  apply_test_hook(rec, topo.rank);
  for (auto& v : rec.values) v = one_line(v);
  return rec;
}

PreflightVerdict judge_preflight(const std::vector<PreflightRecord>& all, const Topology& topo, bool nccl_backend) {
  PreflightVerdict v;
  const auto& fields = preflight_fields();
  const int n = static_cast<int>(all.size());
  std::vector<std::string> agreed;
  for (size_t f = 0; f < fields.size(); ++f) {
    std::map<std::string, std::vector<int>> ranks_of;  // value -> ranks
    for (int r = 0; r < n; ++r) ranks_of[all[r].values[f]].push_back(r);
    for (const auto& [value, ranks] : ranks_of)
      v.table.push_back(concat(fields[f].label, "\t", value.empty() ? "-" : value, "\t", ranks_on_hosts(ranks, topo)));
    if (fields[f].rule == PreflightRule::kOwn) continue;
    const std::string& ref = all[0].values[f];
    if (ranks_of.size() == 1) {
      if (!ref.empty()) agreed.push_back(concat(fields[f].label, " ", ref));
      continue;
    }
    for (const auto& [value, ranks] : ranks_of) {
      if (value == ref) continue;
      const std::string line =
          concat(fields[f].label, " ", value.empty() ? "(none)" : value, " on ", ranks_on_hosts(ranks, topo),
                 " differs from rank 0's ", ref.empty() ? "(none)" : ref, " on host ", topo.hosts[topo.host_of_rank[0]]);
      if (fields[f].rule == PreflightRule::kBreaks) v.errors.push_back(concat("preflight: ", line, ": ", fix_for(fields[f].key)));
      else v.warnings.push_back(concat("preflight: ", line, " (allowed; the slowest GPU sets the pace)"));
    }
  }

  // Two ranks on one physical GPU.
  const size_t bus = field_index("bus_id");
  std::map<std::pair<int, std::string>, std::vector<int>> on_gpu;
  for (int r = 0; r < n; ++r)
    if (!all[r].values[bus].empty()) on_gpu[{topo.host_of_rank[r], all[r].values[bus]}].push_back(r);
  for (const auto& [where, ranks] : on_gpu) {
    if (ranks.size() < 2 || !nccl_backend) continue;
    v.errors.push_back(concat("train.device: ranks ", rank_ranges(ranks), " on host ", topo.hosts[where.first],
                              " would all train on GPU ", where.second,
                              "; NCCL needs one GPU per rank: start one rank per GPU there (mpirun --map-by ppr:G:node, "
                              "srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per rank), or set comm.backend: mpi to "
                              "share GPUs"));
  }

  // /dev/shm where ranks share a host: a container's 64 MiB default breaks shared-memory transports.
  const size_t shm = field_index("shm");
  std::vector<int> small_shm;
  for (int r = 0; r < n; ++r) {
    const std::string& s = all[r].values[shm];
    const bool mib = s.find("MiB") != std::string::npos;
    const bool shared_host = std::count(topo.host_of_rank.begin(), topo.host_of_rank.end(), topo.host_of_rank[r]) > 1;
    if ((mib || s == "(none)") && shared_host) small_shm.push_back(r);
  }
  if (!small_shm.empty())
    v.warnings.push_back(concat("preflight: /dev/shm is under 1 GiB (", all[small_shm[0]].values[shm], ") on ",
                                ranks_on_hosts(small_shm, topo),
                                ", where ranks share the host: shared-memory transfers between them (NCCL, MPI) can "
                                "fail or crawl; give the container more (docker run --shm-size=8g, or --ipc=host)"));

  // NCCL's network (NCCL only): never lo or docker0 between hosts, and the one MPI was pinned to.
  if (nccl_backend && topo.hosts.size() > 1) {
    const size_t nif = field_index("nccl_if"), mif = field_index("mpi_if");
    std::vector<int> bad_if, other_if;
    for (int r = 0; r < n; ++r) {
      const std::string& nv = all[r].values[nif];
      bool bad = false;
      for (const auto& name : nccl_interface_names(nv)) bad = bad || lo_or_docker(name);
      if (bad) bad_if.push_back(r);
      const std::string& mv = all[r].values[mif];
      if (!mv.empty() && nv.rfind("NCCL_SOCKET_IFNAME=", 0) == 0) {
        const auto nccl_names = nccl_interface_names(nv);
        const auto mpi_names = interface_names(mv.substr(mv.find('=') + 1));
        if (nccl_names != mpi_names) other_if.push_back(r);
      }
    }
    if (!bad_if.empty())
      v.warnings.push_back(concat("preflight: NCCL would use ", all[bad_if[0]].values[nif], " on ",
                                  ranks_on_hosts(bad_if, topo),
                                  ": loopback or a docker bridge does not reach other hosts; set NCCL_SOCKET_IFNAME "
                                  "to the interface between the hosts (mpitrain netcheck lists them)"));
    if (!other_if.empty())
      v.warnings.push_back(concat("preflight: ", all[other_if[0]].values[nif], " but MPI is pinned to ",
                                  all[other_if[0]].values[mif], " on ", ranks_on_hosts(other_if, topo),
                                  ": NCCL and MPI use different networks; unset NCCL_SOCKET_IFNAME (mpitrain then "
                                  "follows MPI's setting) or make the two equal"));
  }

  // The launcher's local rank against MPI's host split, whose local ranks number each host's
  // ranks in rank order (Topology::discover splits with the rank as key).
  std::vector<int> local_rank_of(topo.host_of_rank.size()), seen(topo.hosts.size());
  for (size_t r = 0; r < local_rank_of.size(); ++r) local_rank_of[r] = seen[topo.host_of_rank[r]]++;
  const size_t lr = field_index("local_rank");
  std::vector<int> disagree;
  for (int r = 0; r < n; ++r) {
    const std::string& s = all[r].values[lr];
    if (s.empty()) continue;
    if (std::atoi(s.substr(s.find('=') + 1).c_str()) != local_rank_of[r]) disagree.push_back(r);
  }
  if (!disagree.empty()) {
    const int r = disagree[0];
    v.warnings.push_back(concat("launch: the launcher's local rank differs from MPI's host split on ",
                                ranks_on_hosts(disagree, topo), ": rank ", r, " has ", all[r].values[lr],
                                ", MPI's split says ", local_rank_of[r],
                                ". Devices and threads follow MPI's split; if MPI sees ranks of one host as "
                                "separate nodes (MPIR_CVAR_NOLOCAL=1, a hostfile naming one host twice), fix the "
                                "launch"));
  }

  v.summary = concat("preflight: ", n, n == 1 ? " rank" : " ranks", " on ", topo.hosts.size(),
                     topo.hosts.size() == 1 ? " host" : " hosts", v.errors.empty() && v.warnings.empty() ? " agree: " : ": ");
  for (size_t i = 0; i < agreed.size(); ++i) v.summary += (i ? ", " : "") + agreed[i];
  return v;
}

PreflightVerdict gather_preflight(MpiComm comm, const Topology& topo, const std::string& torch_version,
                                  const GpuFacts& gpu, bool nccl_backend) {
  const PreflightRecord mine = collect_preflight(topo, torch_version, gpu);
  std::string packed;
  for (const auto& value : mine.values) packed += value + "\n";
  const auto texts = allgather_text(comm, packed, kRecordBytes);
  std::vector<PreflightRecord> records(topo.size);
  for (int r = 0; r < topo.size; ++r) {
    records[r].values = split_list(texts[r], '\n');
    records[r].values.resize(preflight_fields().size());  // drops the text after the last '\n'
  }
  return judge_preflight(records, topo, nccl_backend);
}

PreflightVerdict run_preflight(MpiComm comm, const Topology& topo, const std::string& torch_version,
                               const GpuFacts& gpu, bool nccl_backend) {
  PreflightVerdict verdict = gather_preflight(comm, topo, torch_version, gpu, nccl_backend);
  if (topo.rank == 0) {
    log::info(verdict.summary);
    for (const auto& w : verdict.warnings) log::warn(w);
  }
  if (!verdict.errors.empty()) {
    std::string msg = verdict.errors.front();
    if (verdict.errors.size() > 1) msg += concat(" (and ", verdict.errors.size() - 1, " more)");
    throw UsageError(msg);
  }
  return verdict;
}

}  // namespace mpitrain
