// The collective watchdog: every collective runs under a deadline. A background thread checks
// it; on expiry it logs the operation, the step, this rank and host, and which ranks have not
// arrived (where they are: their step and their last collective), then aborts the whole job
// (MPI_Abort; NCCL communicators are aborted first by the hook the NCCL backend registers).
// Without it, one rank that stops calling collectives hangs every other rank forever.
//
// How the waiting rank learns who has not arrived: every rank counts the collectives it enters
// (a sequence number kept by Scope: a few plain stores per collective, no lock, no clock read)
// and its watchdog thread, which looks every 10 ms and times what it sees, answers "where are
// you?" queries from other ranks over a private duplicate of MPI_COMM_WORLD (point-to-point,
// polled with MPI_Iprobe; this needs MPI_THREAD_MULTIPLE). The thread answers while the main
// thread sleeps in user code or waits in a collective. The rank whose deadline expires first asks
// every other rank, waits at most kQueryDeadlineS for the answers, names the ranks that are behind
// it (fewer collectives entered) and those that did not answer, and aborts. When several ranks
// expire together only one prints (the lowest rank among those reporting at the same moment).
//
// Exit code of a watchdog abort: kExitWatchdog (signals.h documents all codes).
#pragma once

#include "mpitrain/mpi_ops.h"

#include <cstdint>
#include <functional>

namespace mpitrain {

constexpr int kExitWatchdog = 3;

class Watchdog {
 public:
  // How long the expired rank waits for the other ranks' answers before aborting anyway.
  static constexpr double kQueryDeadlineS = 3.0;

  // Called once by MpiSession right after MPI_Init_thread, on every rank (collective over
  // `world`): with more than one rank and `thread_multiple`, duplicates `world`, gathers every
  // rank's host name and starts the thread that answers queries. Otherwise it does nothing and an
  // expiry reports only this rank's view.
  static void attach(MpiComm world, bool thread_multiple);
  // Stops and joins the thread and frees the duplicate communicator; call before MPI_Finalize.
  static void detach();

  // Arms the deadline check (idempotent; later calls update the timeouts).
  static void start(double timeout_s, double first_timeout_s);
  // The step that collectives belong to, for the message.
  static void set_step(int64_t step);
  // Called once before aborting (e.g. ncclCommAbort).
  static void on_abort(std::function<void()> hook);

  // Marks one collective: the deadline runs from construction to destruction. Nested scopes
  // count as the outermost one. Collectives are expected on one thread (the main thread). `op`
  // must live as long as the program (a string literal): other ranks' queries may read it later.
  class Scope {
   public:
    explicit Scope(const char* op);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    bool outer_;
  };
};

// Test-only fault hook: with MPITRAIN_TEST_HANG="RANK:STEP" in the environment, that rank stops
// calling collectives (sleeps) once it reaches that step. Returns immediately otherwise.
void maybe_hang_for_test(int rank, int64_t step);

}  // namespace mpitrain
