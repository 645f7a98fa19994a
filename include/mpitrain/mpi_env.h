// Everything a rank learns from MPI alone: world rank and size, host-local rank and the host map.
// No rendezvous server, no environment variables: MPI_Init_thread and MPI_Comm_split_type.
#pragma once

#include "mpitrain/mpi_ops.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace mpitrain {

// Owns MPI_Init_thread / MPI_Finalize. Works as a singleton (no mpirun: world size 1).
class MpiSession {
 public:
  MpiSession(int& argc, char**& argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Ends every rank of the job with `code` (MPI_Abort); with one rank, a plain exit.
  [[noreturn]] void abort(int code);

 private:
  int rank_ = 0;
  int size_ = 1;
};

// MPI_Abort(MPI_COMM_WORLD, code) after flushing stdio and pausing kAbortDrainS, so that the
// launcher forwards what this rank just printed: hydra's proxy drops a rank's unread output
// when the abort reaches it first (the watchdog's report was lost so, once in about 12 runs).
// Returns only if MPI_Abort does.
inline constexpr double kAbortDrainS = 0.5;
void abort_world(int code);

// Where the ranks are: computed collectively over `comm` (every rank must call it).
struct Topology {
  int rank = 0;                    // rank in comm
  int size = 1;                    // ranks in comm
  int local_rank = 0;              // rank among the ranks on this host
  int local_size = 1;              // ranks on this host
  int host_index = 0;              // index of this host in `hosts`
  std::string host;                // this rank's host name
  std::vector<std::string> hosts;  // distinct host names in order of their lowest rank
  std::vector<int> host_of_rank;   // host index of every rank

  static Topology discover(MpiComm comm);
  // "4 ranks on 2 hosts: hostA[0-1] hostB[2-3]"
  std::string host_map() const;
};

// Runs `phase` on every rank of `comm` and agrees on the outcome: if any rank threw UsageError,
// the lowest such rank prints its message once and every rank throws ReportedUsageError.
// Use it for start-up phases whose bad input may be seen by only some ranks.
struct ReportedUsageError {
  int exit_code = 2;
};
void agree(MpiComm comm, const std::function<void()>& phase);

// The per-step agreement of a world whose groups are joined by slow links (DiLoCo's islands,
// diloco.h), where a blocking world all-reduce per step would cost a round trip on the slow link,
// and on a shaped one queue behind the outer exchanges' bytes. Each step's verdict (a rank's bad
// input, the highest stop signal) is agreed at once inside the group (fast links) and over the
// world one step's compute later: post() starts a nonblocking all-reduce before the step's work,
// complete() finishes it after, before any collective that crosses the groups. A group that
// failed waits for the world's verdict at once and ends there; the others end one step later.
// Either way every rank throws ReportedUsageError with the lowest failing rank's message printed
// once by that rank, and no rank is left waiting in a collective the failed ones never reach.
class LaggedAgreement {
 public:
  // Collective over `world` (duplicates it: the verdicts are ordered apart from other traffic).
  // `group`: this rank's group, a sub-communicator of `world`.
  LaggedAgreement(MpiComm world, MpiComm group);
  ~LaggedAgreement();
  LaggedAgreement(const LaggedAgreement&) = delete;
  LaggedAgreement& operator=(const LaggedAgreement&) = delete;

  // Runs `check` and agrees on it inside the group (a UsageError it throws is this rank's
  // failure), then posts this step's verdict with this rank's pending `signal` (0: none). A
  // verdict still posted is completed first. A failed group completes it at once: throws.
  void post(const std::function<void()>& check, int signal);
  // Completes the posted verdict (none posted: returns 0). Throws ReportedUsageError when any
  // rank failed, else returns the highest signal posted by any rank.
  int complete();

 private:
  struct Posted;                    // the verdict in flight: its MPI request and buffers
  MpiComm world_ = MpiComm{};       // owned duplicate
  MpiComm group_;
  int rank_ = 0;                    // in world
  std::string message_;             // this rank's failure, if any
  std::unique_ptr<Posted> posted_;
};

// The singleton guard: a launcher that started several tasks while MPI made a world of one
// (each task alone: a binary of one MPI family under another family's launcher, or srun without
// the PMI plugin this MPI speaks) is a UsageError naming the variable that says so and the
// launch to use instead. Read: OMPI_COMM_WORLD_SIZE (Open MPI's mpirun), PMI_SIZE (hydra's
// mpiexec, Intel MPI, srun --mpi=pmi2), SLURM_STEP_NUM_TASKS (a task of srun; sbatch's batch
// script itself has none).
void check_not_a_singleton(int world_size);

// The MPI library this process loaded, from MPI_Get_library_version (callable before MPI_Init):
// "Open MPI v4.1.4", "MPICH 4.0.2", "Intel(R) MPI Library 2021.10 for Linux* OS".
std::string mpi_library();
// The MPI family this binary was compiled for, first word "openmpi", "mpich" or "other", then the
// headers' version: "mpich (built against MPICH 4.0.2; ...)". `mpitrain --version` prints it.
std::string mpi_build();

// Every rank's `mine` in rank order, each cut to `max_bytes` - 1 bytes: one fixed-size
// MPI_Allgather over `comm` (collective).
std::vector<std::string> allgather_text(MpiComm comm, const std::string& mine, size_t max_bytes);

// Compact rank ranges: {0,1,2,5} -> "0-2,5".
std::string rank_ranges(const std::vector<int>& ranks);

}  // namespace mpitrain
