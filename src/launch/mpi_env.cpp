// MPI start-up, the host map, and agreement on start-up errors.
#include "mpitrain/mpi_env.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <thread>

#include "mpitrain/error.h"
#include "mpitrain/log.h"
#include "mpitrain/mpi_native.h"
#include "mpitrain/watchdog.h"

namespace mpitrain {

// ---- MpiSession --------------------------------------------------------------------------------

namespace {
// Open MPI 4 starts a singleton (a process that no launcher started: `mpitrain pack`, `inspect`,
// a one-rank run) by forking a daemon (orted) that it then waits for: about a second of every such
// command, for the MPI_Comm_spawn support mpitrain never uses. Where no launcher's variables are
// set, the singleton is made isolated (no daemon), unless the user set the parameter. Under a
// launcher nothing changes. (Open MPI 5 starts singletons without a daemon.)
void isolate_openmpi_singleton() {
#if defined(OPEN_MPI) && OPEN_MPI && defined(OMPI_MAJOR_VERSION) && OMPI_MAJOR_VERSION < 5
  static const char* const kLauncherVars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_NAMESPACE", "PMI_RANK",
                                              "PMI_FD",               "PMI_SIZE",  "SLURM_STEP_NUM_TASKS"};
  for (const char* v : kLauncherVars)
    if (std::getenv(v)) return;
  setenv("OMPI_MCA_ess_singleton_isolated", "1", /*overwrite=*/0);
#endif
}
}  // namespace

MpiSession::MpiSession(int& argc, char**& argv) {
  isolate_openmpi_singleton();
  // MPI_THREAD_MULTIPLE lets the watchdog thread answer and ask other ranks while the main thread
  // is inside a collective (watchdog.h). MPITRAIN_WATCHDOG_PEERS=0 asks for MPI_THREAD_FUNNELED.
  const char* peers = std::getenv("MPITRAIN_WATCHDOG_PEERS");
  const bool want_multiple = !(peers && std::string(peers) == "0");
  int provided = 0;
  MPI_CHECK(MPI_Init_thread(&argc, &argv, want_multiple ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED, &provided));
  // Errors come back as codes so MPI_CHECK can name the call, rank and host.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  char name[MPI_MAX_PROCESSOR_NAME];
  int len = 0;
  MPI_Get_processor_name(name, &len);
  log::init(rank_, size_, std::string(name, static_cast<size_t>(len)));
  Watchdog::attach(from_mpi(MPI_COMM_WORLD), provided >= MPI_THREAD_MULTIPLE);  // collective
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  Watchdog::detach();  // joins the watchdog thread, frees its communicator
  MPI_Finalize();
}

void abort_world(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::duration<double>(kAbortDrainS));
  MPI_Abort(MPI_COMM_WORLD, code);
}

void MpiSession::abort(int code) {
  if (size_ == 1) {
    std::fflush(stdout);
    std::fflush(stderr);
    Watchdog::detach();
    MPI_Finalize();
    std::_Exit(code);
  }
  abort_world(code);
  std::_Exit(code);  // MPI_Abort does not return; this keeps [[noreturn]] honest
}

// ---- which MPI ----------------------------------------------------------------------------------

std::string mpi_library() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(text, &len);
  std::string s(text, static_cast<size_t>(std::max(0, len)));
  s = one_line(s.substr(0, std::min(s.find('\n'), s.find(','))));
  const std::string kMpich = "MPICH Version: ";  // MPICH's own first line
  if (s.rfind(kMpich, 0) == 0) s = "MPICH " + s.substr(kMpich.size());
  return s;
}

#define MPITRAIN_STR2(x) #x
#define MPITRAIN_STR(x) MPITRAIN_STR2(x)
std::string mpi_build() {
#if defined(OPEN_MPI) && OPEN_MPI
  return "openmpi (built against Open MPI " MPITRAIN_STR(OMPI_MAJOR_VERSION) "." MPITRAIN_STR(
      OMPI_MINOR_VERSION) "." MPITRAIN_STR(OMPI_RELEASE_VERSION) ")";
#elif defined(MPICH_VERSION)
  return "mpich (built against MPICH " MPICH_VERSION "; runs with MPICH-ABI libraries)";
#else
  return "other (built against an MPI that is neither Open MPI nor MPICH)";
#endif
}
#undef MPITRAIN_STR
#undef MPITRAIN_STR2

// ---- the singleton guard -----------------------------------------------------------------------

void check_not_a_singleton(int world_size) {
  if (world_size != 1) return;
#if defined(OPEN_MPI) && OPEN_MPI
  const char* ours = "Open MPI";
  const char* use = "launch it with Open MPI's mpirun, or under Slurm with srun --mpi=pmix";
#elif defined(MPICH_VERSION)
  const char* ours = "an MPICH-family MPI (" MPICH_VERSION ")";
  const char* use = "launch it with that MPI's mpiexec (hydra), or under Slurm with srun --mpi=pmi2";
#else
  const char* ours = "this binary's MPI";
  const char* use = "launch it with that MPI's own launcher";
#endif
  static const std::pair<const char*, const char*> kLaunchers[] = {
      {"OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"},
      {"PMI_SIZE", "a PMI launcher (MPICH's hydra mpiexec, Intel MPI, srun --mpi=pmi2)"},
      {"SLURM_STEP_NUM_TASKS", "srun"},
  };
  for (const auto& [var, who] : kLaunchers) {
    const char* v = std::getenv(var);
    char* end = nullptr;
    const long n = v ? std::strtol(v, &end, 10) : 0;
    if (!v || end == v || *end != '\0' || n <= 1) continue;
    throw UsageError(concat("launch: ", var, "=", n, " says ", who, " started ", n,
                            " tasks, but MPI made a world of 1 rank: every task runs alone. This binary is built with ",
                            ours, "; ", use, " (docs/operations.md, launchers)"));
  }
}

// ---- Topology ----------------------------------------------------------------------------------

Topology Topology::discover(MpiComm handle) {
  const MPI_Comm comm = to_mpi(handle);
  Topology t;
  MPI_CHECK(MPI_Comm_rank(comm, &t.rank));
  MPI_CHECK(MPI_Comm_size(comm, &t.size));

  MPI_Comm local;
  MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, t.rank, MPI_INFO_NULL, &local));
  MPI_CHECK(MPI_Comm_rank(local, &t.local_rank));
  MPI_CHECK(MPI_Comm_size(local, &t.local_size));

  // The shared-memory split defines the hosts; the leader of each (local rank 0) names it.
  int leader = t.rank;
  MPI_CHECK(MPI_Bcast(&leader, 1, MPI_INT, 0, local));
  MPI_Comm_free(&local);

  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_CHECK(MPI_Get_processor_name(name, &len));
  t.host.assign(name, static_cast<size_t>(len));

  std::vector<int> leaders(t.size);
  MPI_CHECK(MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, comm));
  std::vector<char> names(static_cast<size_t>(t.size) * MPI_MAX_PROCESSOR_NAME);
  MPI_CHECK(MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(),
                          MPI_MAX_PROCESSOR_NAME, MPI_CHAR, comm));

  std::map<int, int> host_of_leader;  // ordered by leader rank = order of lowest rank
  for (int l : leaders) host_of_leader.emplace(l, 0);
  int idx = 0;
  for (auto& [l, h] : host_of_leader) {
    h = idx++;
    t.hosts.emplace_back(&names[static_cast<size_t>(l) * MPI_MAX_PROCESSOR_NAME]);
  }
  t.host_of_rank.resize(t.size);
  for (int r = 0; r < t.size; ++r) t.host_of_rank[r] = host_of_leader[leaders[r]];
  t.host_index = t.host_of_rank[t.rank];
  return t;
}

std::vector<std::string> allgather_text(MpiComm handle, const std::string& mine, size_t max_bytes) {
  const int size = mpi::size(handle);
  std::vector<char> buf(max_bytes, '\0'), all(max_bytes * static_cast<size_t>(size));
  std::copy_n(mine.data(), std::min(mine.size(), max_bytes - 1), buf.data());
  mpi::all_gather(buf.data(), all.data(), max_bytes, handle);
  std::vector<std::string> out;
  for (int r = 0; r < size; ++r) out.emplace_back(&all[static_cast<size_t>(r) * max_bytes]);
  return out;
}

std::string rank_ranges(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

std::string Topology::host_map() const {
  std::string out = concat(size, size == 1 ? " rank" : " ranks", " on ", hosts.size(),
                        hosts.size() == 1 ? " host:" : " hosts:");
  for (size_t h = 0; h < hosts.size(); ++h) {
    std::vector<int> ranks;
    for (int r = 0; r < size; ++r)
      if (host_of_rank[r] == static_cast<int>(h)) ranks.push_back(r);
    out += concat(" ", hosts[h], "[", rank_ranges(ranks), "]");
  }
  return out;
}

// ---- agree -------------------------------------------------------------------------------------

void agree(MpiComm handle, const std::function<void()>& phase) {
  const MPI_Comm comm = to_mpi(handle);
  std::string message;
  try {
    phase();
  } catch (const UsageError& e) {
    message = e.what();
    if (message.empty()) message = "usage error";
  }
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  int mine = message.empty() ? INT_MAX : rank, first = INT_MAX;
  MPI_CHECK(MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm));
  if (first == INT_MAX) return;
  if (rank == first) std::fprintf(stderr, "mpitrain: %s\n", message.c_str());
  std::fflush(stderr);
  throw ReportedUsageError{2};
}

// ---- LaggedAgreement ---------------------------------------------------------------------------

struct LaggedAgreement::Posted {
  MPI_Request request = MPI_REQUEST_NULL;
  int send[2] = {0, 0}, recv[2] = {0, 0};  // {lowest failing rank, -signal}, reduced by MIN
};

LaggedAgreement::LaggedAgreement(MpiComm world, MpiComm group)
    : world_(mpi::dup(world)), group_(group), rank_(mpi::rank(world_)), posted_(std::make_unique<Posted>()) {}

LaggedAgreement::~LaggedAgreement() {
  // A verdict still posted (an exception left the step between post and complete) is completed:
  // every rank posted it, so this returns; freeing the communicator under it would be erroneous.
  if (posted_->request != MPI_REQUEST_NULL) MPI_Wait(&posted_->request, MPI_STATUS_IGNORE);
  mpi::free(world_);
}

void LaggedAgreement::post(const std::function<void()>& check, int signal) {
  complete();  // (the caller completes each step's; this keeps the order if it did not)
  message_.clear();
  try {
    check();
  } catch (const UsageError& e) {
    message_ = e.what();
    if (message_.empty()) message_ = "usage error";
  }
  const int mine = message_.empty() ? INT_MAX : rank_;
  int group_first = INT_MAX;
  {
    Watchdog::Scope watch("all_reduce(step check, island)");
    MPI_CHECK(MPI_Allreduce(&mine, &group_first, 1, MPI_INT, MPI_MIN, to_mpi(group_)));
  }
  Posted& p = *posted_;
  p.send[0] = group_first;
  p.send[1] = -signal;
  MPI_CHECK(MPI_Iallreduce(p.send, p.recv, 2, MPI_INT, MPI_MIN, to_mpi(world_), &p.request));
  if (group_first != INT_MAX) complete();  // throws
}

int LaggedAgreement::complete() {
  Posted& p = *posted_;
  if (p.request == MPI_REQUEST_NULL) return 0;
  {
    Watchdog::Scope watch("all_reduce(step check, world)");
    MPI_CHECK(MPI_Wait(&p.request, MPI_STATUS_IGNORE));
  }
  if (p.recv[0] != INT_MAX) {
    if (rank_ == p.recv[0]) std::fprintf(stderr, "mpitrain: %s\n", message_.c_str());
    std::fflush(stderr);
    throw ReportedUsageError{2};
  }
  return -p.recv[1];
}

}  // namespace mpitrain
